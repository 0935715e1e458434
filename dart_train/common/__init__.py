"""Plumbing every part of training shares: ranks, world size and the process group (`dist`).

The lowest layer: imports nothing else of dart_train.
"""
