"""bf16 weights with fp32 compute (`use_bf16_weights`), for CPUs without bf16 arithmetic.

A decoding step (one token, or a tree of a few) reads every weight of the target once and is bound
by memory bandwidth: SmolLM2-135M's fp32 linears are 538 MB a step. Rounded to bf16 they are 270 MB,
and `torch.ops.dart.bf16_weight_linear` (dart_infer/csrc/kernels/bf16_weight_linear.cpp, AVX2 + FMA)
widens them to fp32 in registers, with fp32 activations and sums. On CPUs that have bf16 arithmetic
(AVX512-BF16, AMX) serving in bfloat16 does this and more; this is for the others.

What changes: every linear weight of the target is rounded to bf16 (exact for a checkpoint released
in bf16, as most are; a rounding of 2^-9 relative otherwise), so the served model is that rounded
model in fp32 arithmetic. A forward of more than `MAX_KERNEL_ROWS` rows (the prompt) multiplies the
rounded fp32 weights with oneDNN's GEMM, on a copy packed for it once (`prompt_linear`): 208 GFLOP/s
against 178 for torch's own `linear` (MKL) on SmolLM2's prompt linears (1,300 rows, AVX2, 2 threads;
vLLM's CPU prompt runs the same oneDNN kernels), for one more fp32 copy of the weights in memory. A
row's result does not depend on how many rows share a kernel call (the kernel sums in one order), so
greedy DART still equals greedy plain decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dart_infer.target.kernels import PANEL_COLUMNS, load_kernels

__all__ = ["MAX_KERNEL_ROWS", "Bf16WeightLinear", "bf16_weights_pay", "prompt_linear", "resolve_bf16_weights",
           "use_bf16_weights", "uses_bf16_weights"]

MAX_KERNEL_ROWS = 64  # the largest verified tree; prompts go through the oneDNN copy
PROMPT_ROWS_HINT = 1024  # the input rows oneDNN blocks the prompt's weights for


class Bf16WeightLinear(nn.Module):
    """An `nn.Linear` whose weight is rounded to bf16 and also kept packed in bf16 for the kernel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        load_kernels()
        with torch.no_grad():
            linear.weight.copy_(linear.weight.to(torch.bfloat16))  # in place: a tied embedding is rounded alike
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("packed", torch.ops.dart.bf16_weight_pack(linear.weight.detach()), persistent=False)
        # The prompt's copy: an opaque oneDNN tensor, so an attribute rather than a buffer (`.to()` and
        # state_dict leave it alone; a served model stays where it is).
        self.prompt_weight = _onednn_packed(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= MAX_KERNEL_ROWS:
            return torch.ops.dart.bf16_weight_linear(x, self.packed, self.bias)
        return prompt_linear(x, self.weight, self.bias, self.prompt_weight)


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] packed for oneDNN's fp32 GEMM (blocked for prompt-sized inputs), or None where
    torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, PROMPT_ROWS_HINT)


def prompt_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a prompt's many rows, through oneDNN's GEMM on `packed`
    (`_onednn_packed(weight)`) when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def bf16_weights_pay(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Where float32 serving is faster with bf16 weights: CPUs without bf16 kernels (AVX2 only), where
    bfloat16 itself is not an option. Measured with AVX2 kernels (SmolLM2-135M, 2 threads,
    `scripts/bench_step.py --bf16-weights`, 300 / 1,400 cached tokens): eager AR step 48.5 / 54.8 ms ->
    21.6 / 25.7, 5-node verification 71.3 / 86.0 -> 23.9 / 34.0; compiled 21.0 / 24.9 -> 18.9 / 21.4 and
    30.4 / 39.2 -> 25.6 / 34.0."""
    from dart_infer.common.machine import cpu_has_bf16_kernels

    return torch.device(device).type == "cpu" and dtype == torch.float32 and not cpu_has_bf16_kernels()


def resolve_bf16_weights(setting: bool | str, dtype_setting: object, dtype: torch.dtype,
                         device: torch.device | str) -> bool:
    """A `bf16_weights` setting as true/false: `auto` is part of dtype=auto (an explicit float32 stays
    the exactness mode): true where `dtype_setting` was auto and `bf16_weights_pay`."""
    if setting not in (True, False, "auto"):
        raise ValueError(f"bf16_weights={setting}: use true, false or auto")
    if setting == "auto":
        return str(dtype_setting) == "auto" and bf16_weights_pay(dtype, device)
    return bool(setting)


def uses_bf16_weights(model: nn.Module) -> bool:
    return any(isinstance(module, Bf16WeightLinear) for module in model.modules())


def use_bf16_weights(model: nn.Module) -> nn.Module:
    """Swap the fp32 CPU `model`'s linears (those with a multiple of 16 outputs) for `Bf16WeightLinear`,
    in place; returns `model`. Refused for other dtypes and devices (bf16 serving does it natively)."""
    parameter = next(model.parameters())
    if parameter.dtype != torch.float32 or parameter.device.type != "cpu":
        raise ValueError(f"bf16 weights are for float32 models on a CPU, not {parameter.dtype} on {parameter.device}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.out_features % PANEL_COLUMNS == 0:
                setattr(parent, name, Bf16WeightLinear(child))
    return model
