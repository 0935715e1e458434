"""Plumbing every part shares: one-line errors and exit codes (`errors`), atomic files and
checksums (`files`), dtype names and `auto` (`dtypes`), the tcmalloc preload (`allocator`), where the
Hydra configs live and dotted-key flattening (`configs`).

The lowest layer: imports nothing else of dart_infer.
"""
