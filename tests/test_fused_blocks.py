"""Fused norms, gated MLPs and rotary embeddings (`dart_infer.target.fused_blocks`, the ops in
dart_infer/csrc/kernels/fused_ops.cpp),
and a model served as on a CPU without bf16 (`DartModel.use_bf16_weights`: bf16 weights, fused blocks, the
decode-attention kernel) still decoding losslessly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import reference, tiny_pair
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from dart_infer import DartModel, TreeSearchSettings
from dart_infer.target.attention import DECODE_KERNEL
from dart_infer.target.bf16_weights import uses_bf16_weights
from dart_infer.target.fused_blocks import FusedGatedMLP, FusedRMSNorm, use_fused_blocks
from dart_infer.target.kernels import load_kernels


@pytest.mark.parametrize("hidden", [8, 37, 576])
def test_ops_compute_the_norm_and_the_gated_activation(hidden: int) -> None:
    load_kernels()
    generator = torch.Generator().manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=generator))
    x = torch.randn(2, 5, hidden, generator=generator) * 3
    with torch.no_grad():
        torch.testing.assert_close(torch.ops.dart.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-5)
    gate, up = torch.randn(2, 3, 64, generator=generator) * 20, torch.randn(2, 3, 64, generator=generator)
    gate[0, 0, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])
    torch.testing.assert_close(torch.ops.dart.silu_mul(torch.cat([gate, up], -1)), F.silu(gate) * up,
                               rtol=1e-5, atol=1e-6)
    # A row's result does not depend on the rows beside it.
    assert torch.equal(torch.ops.dart.rms_norm(x[:1, :1], norm.weight, 1e-5)[0, 0],
                       torch.ops.dart.rms_norm(x, norm.weight, 1e-5)[0, 0])


@pytest.mark.parametrize("dim", [64, 10, 128])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rotary_op_is_transformers_rotation_bit_for_bit(dim: int, tokens: int) -> None:
    load_kernels()
    generator = torch.Generator().manual_seed(dim + tokens)
    # As the attention makes them: [B, T, H*D] projections viewed as heads and transposed (strided).
    query = (torch.randn(2, tokens, 9 * dim, generator=generator) * 3).view(2, tokens, 9, dim).transpose(1, 2)
    key = (torch.randn(2, tokens, 3 * dim, generator=generator) * 3).view(2, tokens, 3, dim).transpose(1, 2)
    for batch in (2, 1):  # cos/sin per sequence, or one for all
        angles = torch.randn(batch, tokens, dim, generator=generator) * 50
        expected = apply_rotary_pos_emb(query, key, angles.cos(), angles.sin())
        got = torch.ops.dart.rotary(query, key, angles.cos(), angles.sin())
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        assert got[0].is_contiguous() and got[0].shape == query.shape
    with pytest.raises(RuntimeError, match=r"cos/sin must be \[B or 1, T, D\]"):
        torch.ops.dart.rotary(query, key, angles[..., 2:].cos(), angles[..., 2:].sin())


def test_only_modules_with_the_same_output_are_replaced() -> None:
    llama, _ = tiny_pair("llama")
    use_fused_blocks(llama)
    assert all(isinstance(layer.mlp, FusedGatedMLP) for layer in llama.model.layers)
    assert isinstance(llama.model.norm, FusedRMSNorm)
    assert all("forward" in vars(layer.self_attn) for layer in llama.model.layers)  # the fused rotation
    qwen3, _ = tiny_pair("qwen3")
    use_fused_blocks(qwen3)
    assert isinstance(qwen3.model.layers[0].self_attn.q_norm, FusedRMSNorm)  # per-head norms too
    assert all("forward" in vars(layer.self_attn) for layer in qwen3.model.layers)
    gemma3, _ = tiny_pair("gemma3")
    use_fused_blocks(gemma3)  # its norm scales by 1 + weight, its MLP is gelu-gated, its attention its own: kept
    assert not any(isinstance(m, (FusedRMSNorm, FusedGatedMLP)) or "forward" in vars(m) for m in gemma3.modules())
    with pytest.raises(ValueError, match="float32 models on a CPU"):
        use_fused_blocks(tiny_pair("llama")[0].to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_served_without_bf16_greedy_dart_and_ar_equal_generate_on_the_served_model(kind: str) -> None:
    base, head = tiny_pair(kind, draft_vocab_size=40)
    model = DartModel(base, head, tree=TreeSearchSettings(draft_top_k=8, beam_width=6, remain_total=12))
    model.use_bf16_weights()
    assert uses_bf16_weights(base) and uses_bf16_weights(head) and base.config._attn_implementation == DECODE_KERNEL
    for i in range(3):
        prompt = torch.randint(3, 48, (1, 4 + 40 * i), generator=torch.Generator().manual_seed(i))
        expected = reference(base, prompt, 32)  # transformers' generate on the served model
        assert torch.equal(model.dart_generate(prompt, max_new_token_num=32), expected), i
        assert torch.equal(model.ar_generate(prompt, max_new_token_num=32), expected), i
