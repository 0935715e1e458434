"""Loading any draft method's head from a directory, embedded name or Hub id, and checking that it
fits a target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dart_infer.methods.dart.model import DartDraftModel
from dart_infer.target.adapter import TargetModel

__all__ = ["check_head_matches_target", "load_draft_model"]


def check_head_matches_target(draft: Any, target: TargetModel, kind: str = "DART") -> None:
    """Raise a ValueError naming every mismatch between a head (of any draft method; `kind` names it
    in the message) and the base model it is paired with."""
    cfg = draft.config
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != base hidden_size {target.hidden_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(
            f"target_hidden_size {cfg.target_hidden_size} != base hidden_size {target.hidden_size}"
        )
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != base vocab_size {target.vocab_size}")
    if draft.fc.in_features != 3 * target.hidden_size:
        problems.append(f"fc takes {draft.fc.in_features} inputs, base gives 3 x {target.hidden_size}")
    if problems:
        raise ValueError(f"the {kind} head does not fit the base model: " + "; ".join(problems))


def load_draft_model(
    path: str | Path, *, dtype: torch.dtype | None = None, model_class: Any = DartDraftModel, kind: str = "DART"
) -> Any:
    """Load a head saved by us or by the authors; any missing, unreadable or mis-shaped tensor is an error.
    `model_class`/`kind`: another method's head class and its name in messages (`DraftMethod.load`;
    `dart_infer.methods.load_head` finds the method from the head's config)."""
    from dart_infer.data.assets import check_model_reference, resolve_model

    check_model_reference(str(path), f"{kind} head", head=True)  # a typo fails here, not on the network
    source = resolve_model(path)
    local = Path(source)
    if local.exists():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{kind} head directory {local} has no config.json")
        if not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
            raise FileNotFoundError(f"{kind} head directory {local} has no weights (model.safetensors)")
    try:
        model, info = model_class.from_pretrained(source, output_loading_info=True, dtype=dtype)
    except Exception as err:  # transformers/safetensors raise many types for a bad checkpoint
        raise ValueError(f"cannot load the {kind} head from '{source}': {err}") from err
    missing = list(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if missing or mismatched:
        raise ValueError(f"incomplete {kind} head at '{source}': missing {missing}, mismatched {mismatched}")
    return model

