"""DART inference: draft model, target adapter, C++ tree search, lossless generation."""
