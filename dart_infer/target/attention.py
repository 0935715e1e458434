"""Grouped-query attention over the cache without copying it (`packed_gqa`).

transformers' SDPA path, given a mask and more than one query row (a verified tree, or any compiled
step), expands each key/value head to its query heads (`repeat_kv`): a copy of the whole attended cache
per layer and step. Measured (2-core Xeon, SmolLM2-135M: 9 query heads, 3 key/value heads, 30 layers;
`scripts/bench_step.py --context 100 1000 3000`), the compiled bf16 AR step grows from 23.6 ms at 100
cached tokens to 39.6 ms at 3,000, and one layer's fp32 attention of 13 rows over 3,008 positions takes
4.3 ms with the copy against 0.72 ms without it.

Here the query heads that share a key/value head are stacked as extra query rows instead (the mask
repeated with them), so SDPA reads the cache as it is. Each row's scores and softmax are the same
computation as before; a test checks the outputs equal the stock path's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["PACKED_GQA", "packed_gqa", "packed_gqa_attention"]

PACKED_GQA = "dart_packed_gqa_sdpa"


def packed_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B,H,q,D], key/value [B,KV,k,D], a mask shared
    by all heads [B|1,1,q,k]. Anything else (no mask, per-head masks, softcapping, sinks, dropout) runs
    transformers' own SDPA function unchanged."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, rows, dim = query.shape
    packable = (
        groups > 1 and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
        and attention_mask.shape[2] == rows and dropout == 0.0
        and all(kwargs.get(name) is None for name in ("softcap", "position_bias", "s_aux"))
    )
    if not packable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads = key.shape[1]
    # Query head h reads key/value head h // groups (repeat_kv's order): rows [g*q, (g+1)*q) of kv head k
    # are query head k*groups + g.
    query = query.reshape(batch, kv_heads, groups * rows, dim)
    masks = attention_mask.shape[0]
    mask = attention_mask[:, :, None].expand(masks, 1, groups, rows, attention_mask.shape[-1])
    mask = mask.reshape(masks, 1, groups * rows, attention_mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, rows, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_GQA, packed_gqa_attention)
AttentionMaskInterface.register(PACKED_GQA, sdpa_mask)  # the same masks as "sdpa"


# Requests served in threads (dart-app) share one model: the first forward in swaps the config, the last
# one out restores it, so no forward sees it change under it.
_lock = threading.Lock()
_users: dict[int, int] = {}


@contextmanager
def packed_gqa(model: torch.nn.Module) -> Iterator[None]:
    """Run `model`'s forwards inside with `packed_gqa_attention` where it uses "sdpa" (else unchanged).
    Scoped, not permanent: the caller's model (and `generate` on it) keeps transformers' own path."""
    # The top config and the text config (the one the decoder's attention modules hold), set directly
    # so that nothing else (sub-configs of other modalities) changes, and restored exactly.
    configs = list({id(c): c for c in (model.config, model.config.get_text_config())}.values())
    with _lock:
        for config in configs:
            if _users.get(id(config)):
                _users[id(config)] += 1
            elif getattr(config, "_attn_implementation_internal", None) == "sdpa":
                config._attn_implementation_internal = PACKED_GQA
                _users[id(config)] = 1
        entered = [c for c in configs if _users.get(id(c))]
    try:
        yield
    finally:
        with _lock:
            for config in entered:
                _users[id(config)] -= 1
                if not _users[id(config)]:
                    del _users[id(config)]
                    config._attn_implementation_internal = "sdpa"
