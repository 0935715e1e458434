"""`compile_decoding`: a `DartModel` whose target (and DART draft step) run as frozen, fixed-shape
compiled graphs (`dart_infer.target.compiled`, `dart_infer.methods.dart.compiled_draft`)."""

from __future__ import annotations

from typing import Any

from dart_infer.target.compiled import CompiledTarget

__all__ = ["compile_decoding"]


def compile_decoding(
    model: Any, *, tree_sizes: tuple[int, ...] | None = None, capacity: int = 1024, plain: bool | None = None
) -> Any:
    """`model` (a `DartModel`) decoding through a `CompiledTarget` from now on, for its AR baseline and
    its tree decoding alike, and a DART head's draft step through `CompiledDraftStep`. `tree_sizes`
    default: its tree settings' usual tree (the tree-size setting's nodes + root) and its largest one
    (`DraftMethod.max_tree_nodes`). Compiles those shapes before it returns (`compile_now`), and the
    plain one-token step only with `plain=True` (default: only when the model has no head): each
    target graph takes about a minute here (SmolLM2-135M, 2 cores), and serving a head never runs
    the plain step. Without it, `ar_generate` compiles that step on its first call. Returns `model`."""
    target = model.target
    if tree_sizes is None:
        tree_sizes = tuple(model.method.padded_tree_sizes(model.tree)) if model.method is not None else (1,)
    model.target = CompiledTarget(model.base_model, target.aux_layer_ids, tree_sizes=tree_sizes, capacity=capacity)
    model.target.compile_now(plain=model.method is None if plain is None else plain, trees=model.method is not None)
    model.target.embedding_weight = target.embedding_weight
    if model.method is not None and model.method.name == "dart":
        from dart_infer.methods.dart.compiled_draft import CompiledDraftStep

        # A step adds 1 + accepted positions: up to the draft's depth, or a copy span's.
        deepest = max(model.method.max_depth(model.draft_model, model.tree), int(model.tree.copy_span_tokens))
        model.compiled_draft = CompiledDraftStep(model.draft_model, max_new=1 + deepest, capacity=capacity)
        model.compiled_draft.compile_now()
    return model
