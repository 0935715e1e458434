"""Draft vocabulary: the most frequent target tokens under the loss mask.

API (used by the `dart-train` CLI):

- `build_vocab_mapping(sequences, target_vocab_size, draft_vocab_size, *, special_token_ids=())
  -> LongTensor[draft_vocab_size]`: the draft→target id map for `DartDraftModel.set_vocab_mapping`
  (which fills t2d bool[vocab] and d2t with target id = i + d2t[i]).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


def build_vocab_mapping(
    sequences: Iterable[Any],
    target_vocab_size: int,
    draft_vocab_size: int,
    *,
    special_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """The `draft_vocab_size` most frequent target tokens under the loss mask, sorted by target id.

    `sequences` yields `{"input_ids", "loss_mask"}` mappings or `(input_ids, loss_mask)` pairs.
    Equal counts are ordered special tokens first, then by smaller target id, so when fewer distinct
    tokens occur than `draft_vocab_size` the rest is filled with `special_token_ids` first, then the
    smallest unused ids. Returns LongTensor[draft_vocab_size] `draft_to_target` (draft id i → target id), the input
    of `DartDraftModel.set_vocab_mapping` (t2d/d2t, target id = i + d2t[i]).
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in 1..target_vocab_size={target_vocab_size}")
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for item in sequences:
        ids, mask = (item["input_ids"], item["loss_mask"]) if isinstance(item, Mapping) else item
        ids = torch.as_tensor(ids).reshape(-1)
        mask = torch.as_tensor(mask, dtype=torch.bool).reshape(-1)
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} differ in shape")
        chosen = ids[mask]
        if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= target_vocab_size):
            raise ValueError(f"token id outside the target vocabulary [0, {target_vocab_size})")
        counts += torch.bincount(chosen, minlength=target_vocab_size)
    # Priority: frequency (desc), then special tokens, then id (asc). A stable sort on a key keeps it exact.
    special = torch.zeros(target_vocab_size, dtype=torch.long)
    for token_id in special_token_ids:
        if token_id is not None and 0 <= int(token_id) < target_vocab_size:
            special[int(token_id)] = 1
    key = counts * 2 + special  # counts dominate; among equal counts (e.g. 0) specials come first
    order = torch.sort(-key, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values

