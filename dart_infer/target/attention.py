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

`DECODE_KERNEL` goes further for float32 on a CPU: a step's few rows (an AR token, a verified tree) run
`torch.ops.dart.decode_attention` (dart_infer/csrc/kernels/decode_attention.cpp), which splits the
cache across threads and gives each row the same bits whatever rows or masked keys share the call; a
causal prompt with nothing cached before it runs `torch.ops.dart.prefill_attention`
(dart_infer/csrc/kernels/prefill_attention.cpp, register-tiled flash attention: 1.4x SDPA at 1,300
tokens, 2x at 100-500, AVX2, 2 threads); other prompts (a mask, a cache before them) run SDPA. It is
a model's own attention implementation (`use_decode_attention`), not scoped to our calls, so
`generate` on that model computes as our loop does. Served with bf16 weights
(`dart_infer.target.bf16_weights`), where the model is already ours; a plain float32 model keeps SDPA.
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

from dart_infer.target.kernels import load_kernels

__all__ = ["DECODE_KERNEL", "PACKED_GQA", "decode_kernel_attention", "packed_gqa", "packed_gqa_attention",
           "use_decode_attention"]

PACKED_GQA = "dart_packed_gqa_sdpa"
DECODE_KERNEL = "dart_decode_kernel"
MAX_DECODE_ROWS = 64  # query rows a call may have for the kernel: the largest verified tree


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


def _kernel_mask(attention_mask: torch.Tensor | None, rows: int, keys: int) -> torch.Tensor | None | bool:
    """The kernel's additive float [rows, keys] mask, None for no mask, False where the kernel can't run."""
    if attention_mask is None:
        return None if rows == 1 else False  # several rows and no mask: a causal prompt, SDPA's
    if attention_mask.dim() != 4 or attention_mask.shape[:2] != (1, 1) or attention_mask.shape[2] != rows:
        return False
    mask = attention_mask[0, 0, :, :keys]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
    return mask.contiguous() if mask.dtype == torch.float32 else False


def _is_causal(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """transformers' rule: the call's `is_causal` where given, else the module's (decoders: True)."""
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)


def decode_kernel_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`packed_gqa_attention`'s arguments (transformers passes dropout, scaling, ... by name); on a float32
    CPU model a step's rows go through `torch.ops.dart.decode_attention` and a causal prompt with nothing
    cached through `torch.ops.dart.prefill_attention`, anything else through `packed_gqa_attention`."""
    batch, heads, rows, dim = query.shape
    mask: torch.Tensor | None | bool = False
    plain = (batch == 1 and query.device.type == "cpu" and query.dtype == torch.float32 and dim % 8 == 0
             and dim <= 256 and not kwargs.get("dropout") and key.stride(-1) == 1 and value.stride(-1) == 1
             and all(kwargs.get(name) is None for name in ("softcap", "position_bias", "s_aux")))
    scaling = kwargs.get("scaling")
    scale = dim**-0.5 if scaling is None else scaling
    if (plain and attention_mask is None and rows > 1 and key.shape[2] == rows and query.stride(-1) == 1
            and kwargs.get("sliding_window") is None and _is_causal(module, kwargs)):
        # A prompt with nothing cached before it: causal, the mask left to is_causal (transformers' sdpa_mask).
        return torch.ops.dart.prefill_attention(query, key, value, scale), None
    if plain and rows <= MAX_DECODE_ROWS:
        mask = _kernel_mask(attention_mask, rows, key.shape[2])
    if mask is False:
        return packed_gqa_attention(module, query, key, value, attention_mask, **kwargs)
    kv_heads = key.shape[1]
    # Query head h reads key/value head h // groups: rows [g*q, (g+1)*q) of kv head k are query head
    # k*groups + g, each reading mask row (its index mod q).
    packed = query.reshape(1, kv_heads, heads // kv_heads * rows, dim)
    out = torch.ops.dart.decode_attention(packed, key, value, mask, scale)
    return out.reshape(1, heads, rows, dim).transpose(1, 2).contiguous(), None


def use_decode_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Make `DECODE_KERNEL` the attention of `model` (a float32 CPU model on "sdpa"), in place, for every
    forward from now on (ours and `generate`'s); returns `model`."""
    load_kernels()
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if getattr(config, "_attn_implementation_internal", None) == "sdpa":
            config._attn_implementation_internal = DECODE_KERNEL
    return model


AttentionInterface.register(PACKED_GQA, packed_gqa_attention)
AttentionMaskInterface.register(PACKED_GQA, sdpa_mask)  # the same masks as "sdpa"
AttentionInterface.register(DECODE_KERNEL, decode_kernel_attention)
AttentionMaskInterface.register(DECODE_KERNEL, sdpa_mask)


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
