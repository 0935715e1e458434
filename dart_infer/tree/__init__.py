"""Draft trees: `settings` (TreeSearchSettings, the default trees, logits -> token trees with
context n-grams and copy spans) over `chain` (a chain: the search's best path, `best_chain`) over
`search` (the C++ beam search, `dart_infer._search`).

May import: `common`.
"""
