"""Fused RMSNorm and gated-MLP modules for a float32 CPU model served with bf16 weights (`use_fused_blocks`).

Eagerly, a one-token step of SmolLM2-135M runs ~1,000 small ops besides its linears: each of transformers'
RMSNorms is eight (cast, pow, mean, add, rsqrt, mul, cast, mul), each gated MLP two linears, a silu and
a mul. `FusedRMSNorm` is one `torch.ops.dart.rms_norm`; `FusedGatedMLP` multiplies gate and up in one
linear ([gate; up] stacked, so with bf16 weights one kernel call reads both) and applies
`torch.ops.dart.silu_mul` (dart_infer/csrc/kernels/fused_ops.cpp).

A module is replaced only where its replacement gives the same output on a probe input (to float
rounding): a norm with another formula (Gemma's 1 + weight) or an MLP with another activation keeps its
own. Like the decode-attention kernel, it changes the served model itself, so `generate` on it computes
as our loop does; plain float32 keeps transformers' modules.
"""

from __future__ import annotations

import torch
from torch import nn

from dart_infer.target.kernels import load_kernels
from dart_infer.target.step_cost import use_fast_matmul_layout

__all__ = ["FusedGatedMLP", "FusedRMSNorm", "use_fused_blocks"]


class FusedRMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dart.rms_norm(x, self.weight, self.eps)


class FusedGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up as one linear."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Module) -> None:
        super().__init__()
        # No random initialisation to overwrite: the stacked weights are the parameter.
        self.gate_up = torch.nn.utils.skip_init(nn.Linear, gate.in_features, 2 * gate.out_features, bias=False)
        self.gate_up.weight = nn.Parameter(torch.cat([gate.weight.detach(), up.weight.detach()]),
                                           requires_grad=gate.weight.requires_grad)
        self.down_proj = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.ops.dart.silu_mul(self.gate_up(x)))


def _same_output(original: nn.Module, fused: nn.Module, width: int) -> bool:
    probe = torch.randn(3, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = original(probe), fused(probe)
    # Rounding differences scale with the largest outputs (a random probe makes an MLP's large), not each one.
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    return expected.shape == got.shape and float((got - expected).abs().max()) <= 1e-5 * max(scale, 1.0)


def _fused(module: nn.Module) -> nn.Module | None:
    """The fused replacement of `module`, or None where there is none that computes the same."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__.endswith("RMSNorm") and isinstance(weight, nn.Parameter) and weight.dim() == 1 \
            and eps is not None:
        fused = FusedRMSNorm(weight, eps)
        return fused if _same_output(module, fused, weight.numel()) else None
    gate, up, down = (getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    if all(type(p) is nn.Linear and p.bias is None for p in (gate, up)) and isinstance(down, nn.Module) \
            and gate.weight.shape == up.weight.shape and gate.out_features % 8 == 0:
        fused = FusedGatedMLP(gate, up, down)
        return fused if _same_output(module, fused, gate.in_features) else None
    return None


def use_fused_blocks(model: nn.Module) -> nn.Module:
    """Replace the RMSNorms and gated MLPs of a float32 CPU `model` by fused ones, in place (before its
    linears become `Bf16WeightLinear`s, so the stacked gate/up does too); returns `model`."""
    parameter = next(model.parameters())
    if parameter.dtype != torch.float32 or parameter.device.type != "cpu":
        raise ValueError(f"fused blocks are for float32 models on a CPU, not {parameter.dtype} on {parameter.device}")
    load_kernels()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            fused = _fused(child)
            if fused is not None:
                setattr(parent, name, fused)
    use_fast_matmul_layout(model)  # the stacked gate/up too: prompts multiply it with torch's GEMM
    return model
