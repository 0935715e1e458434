"""Fixed costs of a decoding step that do not depend on the model family (docs/results/
step_profile_2026-12-03.md), shared by the target adapter (`dart_infer.target.adapter`) and `DartModel`:

- `GrowingLayer`: a transformers cache layer that appends in place into spare room instead of
  concatenating the whole cache on every forward;
- `use_fast_matmul_layout`: linear weights stored in the layout the matmul kernel is fastest with on
  the device (column-major for float32 on CPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

__all__ = ["GrowingLayer", "fast_matmul_layout", "use_fast_matmul_layout"]


def fast_matmul_layout(weight: torch.Tensor) -> bool:
    """Whether `F.linear(x, weight)` is faster here with `weight` [out, in] stored column-major.

    float32 on CPU (MKL/oneDNN): measured with one thread on SmolLM2's shapes (AVX512 Xeon), the
    transposed copy runs the 8–13-row products of a tree verification or a draft step 2.3–2.8x
    faster for the MLP (1536x576, 576x1536) and 49152x576 lm_head matrices and 1.3x for 576x576,
    and one-row products equally fast or faster. bfloat16 (AMX) and CUDA kernels are as fast or
    faster row-major, so they keep the default layout.
    """
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def use_fast_matmul_layout(module: nn.Module) -> int:
    """Store every `nn.Linear` weight of `module` in the layout `fast_matmul_layout` prefers.

    Same values and shapes, only the strides change (column-major = the transposed matrix stored
    contiguously), so every caller of the module, `generate()` included, gets the faster kernel, and
    `save_pretrained` still writes contiguous tensors. Tied weights (an lm_head sharing the input
    embedding) are converted once; embedding lookups read a column-major matrix a little slower
    (measured: 3 us per decoded token, 1.5 ms per 300-token prompt). Call it again after moving the
    module to another device or dtype. Returns how many weights changed layout.
    """
    changed = 0
    seen: set[int] = set()
    for submodule in module.modules():
        weight = getattr(submodule, "weight", None)
        if not isinstance(submodule, nn.Linear) or weight is None or weight.dim() != 2 or id(weight) in seen:
            continue
        seen.add(id(weight))
        column_major = weight.t().is_contiguous()
        if fast_matmul_layout(weight) and not column_major:
            weight.data = weight.data.t().contiguous().t()
            changed += 1
        elif not fast_matmul_layout(weight) and not weight.is_contiguous():
            weight.data = weight.data.contiguous()
            changed += 1
    return changed


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views into buffers with spare room.

    `DynamicLayer.update` concatenates the whole cache with the new entries on every forward (a copy
    of every cached K/V per token: at 400 cached tokens of SmolLM2 in float32, 36 MB of memory
    traffic per step); here new entries are written in place and the buffers double when full.
    `keys`/`values` stay plain tensors (views of the first `length` entries), so truncating them
    (`crop`, `TargetModel.keep_path`) frees room for the next update without copying; anything that
    replaces them with other tensors is picked up by the next update (copied into a new buffer).
    """

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _in_buffer(self, length: int) -> bool:
        """True when keys/values are still the first `length` entries of this layer's buffers."""
        buffers = (self._key_buffer, self._value_buffer)
        for tensor, buffer in zip((self.keys, self.values), buffers, strict=True):
            if buffer is None or length == 0:
                return buffer is not None
            if tensor.data_ptr() != buffer.data_ptr() or tensor.stride() != buffer.stride():
                return False
        return True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        needed = length + key_states.shape[-2]
        buffer = self._key_buffer
        fits = (
            buffer is not None
            and buffer.shape[-2] >= needed
            and buffer.shape[:2] == key_states.shape[:2]
            and buffer.shape[-1] == key_states.shape[-1]
            and self._value_buffer is not None
            and self._value_buffer.shape[-1] == value_states.shape[-1]
            and buffer.dtype == key_states.dtype
            and buffer.device == key_states.device
        )
        if not (fits and self._in_buffer(length)):
            capacity = max(256, 2 * needed)
            keys = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[-1]))
            values = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[-1]))
            if length:
                keys[:, :, :length] = self.keys
                values[:, :, :length] = self.values
            self._key_buffer, self._value_buffer = keys, values
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[:, :, length:needed] = key_states
        self._value_buffer[:, :, length:needed] = value_states
        self.keys = self._key_buffer[:, :, :needed]
        self.values = self._value_buffer[:, :, :needed]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None
