"""What every draft head shares (DART's, `dart_infer.methods.dart.model`; EAGLE-3's, `dart_infer.methods.eagle3.model`):
the parts around the one draft layer, the draft layer's K/V cache and causal masks.

`DraftHeadParts` is a mixin of the head classes (each a `PreTrainedModel` with its own layer): `fc`
over the three aux hidden states, `norm`, `lm_head` over the draft vocabulary, the rotary embedding,
the draft vocabulary (`t2d`/`d2t`) and the target's input embedding, attached, frozen and never saved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import initialization as hf_init
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

__all__ = ["DraftHeadParts", "DraftKVCache", "causal_mask"]


class DraftKVCache:
    """K/V of the draft layer for prefix positions only (DART's mask positions and EAGLE-3's tree nodes
    are recomputed every round).

    `extend` writes a call's new K/V right after the committed prefix and returns committed + new;
    `commit(n)` then keeps the first n of them (the new prefix positions). Storage grows by doubling,
    so a step copies only its own new entries.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0
        self._pending = 0

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = keys.shape[-2]
        needed = self.length + new
        if self.keys is None or self.keys.shape[-2] < needed or self.keys.shape[:2] != keys.shape[:2]:
            capacity = max(256, 2 * needed)
            shape = (*keys.shape[:2], capacity, keys.shape[-1])
            grown_k = keys.new_empty(shape)
            grown_v = values.new_empty(shape)
            if self.keys is not None and self.length:
                grown_k[:, :, : self.length] = self.keys[:, :, : self.length]
                grown_v[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, :, self.length : needed] = keys
        self.values[:, :, self.length : needed] = values
        self._pending = new
        return self.keys[:, :, :needed], self.values[:, :, :needed]

    def commit(self, n: int) -> None:
        if not 0 <= n <= self._pending:
            raise ValueError(f"cannot commit {n} positions: the last call added {self._pending}")
        self.length += n
        self._pending = 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a draft cache of length {self.length} to {length}")
        self.length = length
        self._pending = 0

    def reset(self) -> None:
        self.length = 0
        self._pending = 0


def causal_mask(query_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [1,1,query_len,kv_len]: the queries are the LAST query_len of kv_len positions (True = attend)."""
    offset = kv_len - query_len
    rows = torch.arange(query_len, device=device)[:, None] + offset
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows)[None, None]


class DraftHeadParts:
    """The parts of a draft head around its layer; mixed into `PreTrainedModel` subclasses."""

    config: Any
    t2d: torch.Tensor
    d2t: torch.Tensor

    def _build(self, config: Any, midlayer: nn.Module) -> None:
        """Make the parts around `midlayer` (called in the head's `__init__`)."""
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = midlayer
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        # Identity mapping onto the first draft_vocab_size target ids until set_vocab_mapping is called.
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def _reset_vocab_mapping(self, module: nn.Module) -> None:
        """`_init_weights` of the head itself: back to the identity draft vocabulary."""
        t2d = torch.zeros_like(module.t2d)
        t2d[: self.config.draft_vocab_size] = True
        hf_init.copy_(module.t2d, t2d)
        hf_init.zeros_(module.d2t)

    def external_parameters(self) -> list[nn.Parameter]:
        """Parameters the head reads directly, not through a submodule's forward (ZeRO-3 must gather
        them with the forward's module): none unless a head says so."""
        return []

    @property
    def embed_tokens(self) -> nn.Embedding | None:
        """The target's input embedding (frozen, shared, not part of this module's state)."""
        return self.__dict__.get("_target_embedding")

    def set_target_embedding(self, weight: torch.Tensor) -> None:
        """Attach the target's input-embedding matrix [vocab, H] (shared storage, frozen, never saved)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"target embedding has shape {tuple(weight.shape)}, this head expects [vocab, hidden] = {expected}"
            )
        embedding = nn.Embedding.from_pretrained(weight.detach(), freeze=True)
        # Kept outside the module registry: not in state_dict/parameters, untouched by .to()/optimisers.
        self.__dict__["_target_embedding"] = embedding

    @torch.no_grad()
    def set_vocab_mapping(self, draft_to_target_ids: torch.Tensor) -> None:
        """Fill t2d/d2t from the target id of every draft id (LongTensor [draft_vocab_size], distinct ids)."""
        ids = torch.as_tensor(draft_to_target_ids, dtype=torch.long).flatten().cpu()
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(
                f"need {self.config.draft_vocab_size} target ids (draft vocab), got {ids.numel()}"
            )
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"target ids must lie in [0, {self.config.vocab_size})")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("draft_to_target_ids contains duplicates")
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.t2d.copy_(t2d.to(self.t2d.device))
        self.d2t.copy_((ids - torch.arange(ids.numel())).to(self.d2t.device))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids (id + d2t[id])."""
        return draft_ids + self.d2t[draft_ids]
