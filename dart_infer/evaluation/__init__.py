"""Measuring τ and wall-clock speedup: the evaluator and its baselines (`evaluate`), the append-only
record store that keeps every measurement (`records`), tables, JSON and plots (`results`), and
`action=fit_tree`, the tree size fitted to the machine (`tree_fit`).

May import: everything below it: `common`, `tree`, `data`, `target`, `methods`, `decoding`, `engines`.
"""
