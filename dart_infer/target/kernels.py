"""Our CPU kernels as torch ops (`torch.ops.dart.*`), from the compiled `dart_infer._kernels` library
(dart_infer/csrc/kernels/, built by `make build`): `bf16_weight_linear` and its `bf16_weight_pack`
(`dart_infer.target.bf16_weights`), `decode_attention` and `prefill_attention` (`dart_infer.target.attention`), `rms_norm` and
`silu_mul`, `rotary` (`dart_infer.target.fused_blocks`). Each has a shape function, so graphs that call them also
trace (torch.compile)."""

from __future__ import annotations

import importlib.util
import threading

import torch

__all__ = ["KERNELS_VERSION", "PANEL_COLUMNS", "load_kernels"]

PANEL_COLUMNS = 16  # bf16_weight_pack's panel width: out_features must be a multiple
# Raised whenever a kernel's speed changes: tree sizes fitted with these kernels (tree="auto") are keyed by
# it, so a machine measures again instead of serving a size fitted to the old step costs.
KERNELS_VERSION = 5

_lock = threading.Lock()
_loaded = False


def load_kernels() -> None:
    """Register torch.ops.dart.*, once per process."""
    global _loaded
    with _lock:
        if _loaded:
            return
        spec = importlib.util.find_spec("dart_infer._kernels")
        if spec is None or spec.origin is None:
            raise RuntimeError("dart_infer._kernels is not built: run `make build` (or pip install -e .)")
        torch.ops.load_library(spec.origin)

        @torch.library.register_fake("dart::bf16_weight_linear")
        def _linear_shape(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return input.new_empty((*input.shape[:-1], packed.shape[0] * PANEL_COLUMNS))

        @torch.library.register_fake("dart::bf16_weight_pack")
        def _pack_shape(weight: torch.Tensor) -> torch.Tensor:
            return weight.new_empty((weight.shape[0] // PANEL_COLUMNS, weight.shape[1], PANEL_COLUMNS),
                                    dtype=torch.bfloat16)

        @torch.library.register_fake("dart::decode_attention")
        def _attention_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             mask: torch.Tensor | None, scale: float) -> torch.Tensor:
            return query.new_empty(query.shape)

        @torch.library.register_fake("dart::prefill_attention")
        def _prefill_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
            return query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))

        @torch.library.register_fake("dart::rms_norm")
        def _norm_shape(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return input.new_empty(input.shape)

        @torch.library.register_fake("dart::rotary")
        def _rotary_shape(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return query.new_empty(query.shape), key.new_empty(key.shape)

        @torch.library.register_fake("dart::silu_mul")
        def _silu_mul_shape(gate_up: torch.Tensor) -> torch.Tensor:
            return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

        _loaded = True
