"""Draft trees: `settings` (TreeSearchSettings, the default trees, logits -> token trees with
context n-grams and copy spans) over `search` (the C++ beam search, `dart_infer._search`).

May import: `common`.
"""
