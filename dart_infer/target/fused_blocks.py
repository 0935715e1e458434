"""Fused RMSNorm, gated-MLP and rotary embedding for a float32 CPU model served with bf16 weights
(`use_fused_blocks`).

Eagerly, a one-token step of SmolLM2-135M runs ~1,000 small ops besides its linears: each of transformers'
RMSNorms is eight (cast, pow, mean, add, rsqrt, mul, cast, mul), each gated MLP two linears, a silu and
a mul, each rotary embedding fourteen. `FusedRMSNorm` is one `torch.ops.dart.rms_norm`; `FusedGatedMLP`
multiplies gate and up in one linear ([gate; up] stacked, so with bf16 weights one kernel call reads both)
and applies `torch.ops.dart.silu_mul`; Llama-style attention modules (`ROTARY_RULES`) get a forward that
rotates queries and keys with `torch.ops.dart.rotary` (transformers' roundings, bit for bit), the rest of
it as transformers' (dart_infer/csrc/kernels/fused_ops.cpp).

A module is replaced only where its replacement gives the same output on a probe input (to float
rounding): a norm with another formula (Gemma's 1 + weight), an MLP with another activation or an
attention with another forward keeps its own. Like the decode-attention kernel, it changes the served
model itself, so `generate` on it computes as our loop does; plain float32 keeps transformers' modules.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dart_infer.target.kernels import load_kernels
from dart_infer.target.step_cost import use_fast_matmul_layout

__all__ = ["ROTARY_RULES", "FusedGatedMLP", "FusedRMSNorm", "FusedRotaryForward", "use_fused_blocks"]

# transformers' attention classes whose forward is Llama's (q/k/v projections, Qwen3's per-head q/k norms
# before the rotation, the cache update, the model's attention function, o_proj), with where each takes
# the `sliding_window` it passes to the attention function (None: it passes none).
ROTARY_RULES: dict[str, str | None] = {
    "LlamaAttention": None,
    "MistralAttention": "config",
    "Qwen2Attention": "module",
    "Qwen3Attention": "module",
}


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


class FusedRotaryForward:
    """A `ROTARY_RULES` attention's forward, the rotation in one op; set as the module's `forward`. What the
    class decides (Qwen3's q/k norms, the eager fallback, where `sliding_window` comes from) is looked up
    once here, not on every call of a decoding step."""

    def __init__(self, attention: nn.Module) -> None:
        self.attention = attention
        self.norms = hasattr(attention, "q_norm")  # Qwen3: RMSNorm over each head's vector before the rotation
        # As transformers looks the function up: the registered one, else the modeling file's own eager one.
        self.eager = sys.modules[type(attention).__module__].eager_attention_forward
        rule = ROTARY_RULES[type(attention).__name__]
        self.window_owner = None if rule is None else attention.config if rule == "config" else attention

    def __call__(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor | None = None, cache: Any = None,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.attention
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, module.head_dim)
        query = module.q_proj(hidden_states).view(hidden_shape)
        key = module.k_proj(hidden_states).view(hidden_shape)
        if self.norms:
            query, key = module.q_norm(query), module.k_norm(key)
        value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = torch.ops.dart.rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, self.eager)
        if self.window_owner is not None:
            kwargs["sliding_window"] = getattr(self.window_owner, "sliding_window", None)
        out, weights = attention(module, query, key, value, attention_mask,
                                 dropout=0.0 if not module.training else module.attention_dropout,
                                 scaling=module.scaling, **kwargs)
        return module.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _use_fused_rotary(attention: nn.Module, config: Any) -> bool:
    """Give `attention` (a `ROTARY_RULES` class) the fused forward where it computes what its own does on a
    probe (a 3-token prompt, then one token over it); returns whether it did."""
    width, dim = int(config.hidden_size), int(attention.head_dim)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(1, 4, width, generator=generator)
    angles = torch.randn(1, 4, dim, generator=generator)
    outputs = []
    fused = FusedRotaryForward(attention)
    for forward in (attention.forward, fused):
        cache = DynamicCache(config=config)
        with torch.no_grad():
            first, _ = forward(tokens[:, :3], (angles[:, :3].cos(), angles[:, :3].sin()), None, cache=cache)
            second, _ = forward(tokens[:, 3:], (angles[:, 3:].cos(), angles[:, 3:].sin()), None, cache=cache)
        outputs.append(torch.cat([first, second], dim=1))
    expected, got = outputs
    scale = max(float(expected.abs().max()), 1.0)
    if expected.shape != got.shape or float((got - expected).abs().max()) > 1e-5 * scale:
        return False
    attention.forward = fused
    return True


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
    text_config = model.config.get_text_config(decoder=True)
    for module in model.modules():
        if type(module).__name__ in ROTARY_RULES and "forward" not in vars(module):
            _use_fused_rotary(module, text_config)
    use_fast_matmul_layout(model)  # the stacked gate/up too: prompts multiply it with torch's GEMM
    return model
