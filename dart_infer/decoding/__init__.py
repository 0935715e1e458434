"""Lossless decoding: the one loop every draft method runs through (`loop`), acceptance and sampling
(`sampling`), per-request statistics (`stats`), `DartModel`, the public API (`dart_model`), and
`compile_decoding` (`compile`); a request's argument checks (`request`).

May import: `common`, `tree`, `data`, `target`, `methods`.
"""
