"""The target model as decoding sees it: the eager adapter (`adapter`: aux hidden states, tree
verification, the KV cache), its in-place cache layer and matmul layout (`step_cost`), grouped-query
attention that reads each KV head once (`attention`), and the same target as frozen fixed-shape
compiled steps over a static cache (`compiled`).

May import: `common`, `tree`, `data`.
"""
