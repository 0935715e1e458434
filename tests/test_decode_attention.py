"""The decode-attention kernel (`torch.ops.dart.decode_attention`, dart_infer/csrc/kernels/decode_attention.cpp)
and the attention implementation around it (`dart_infer.target.attention.DECODE_KERNEL`): SDPA's result for a
step's rows over a strided cache, each row the same bits whatever rows or masked keys share the call, and
greedy decoding through it still lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import reference, tiny_pair

from dart_infer import DartModel, TreeSearchSettings
from dart_infer.target.attention import DECODE_KERNEL, decode_kernel_attention, use_decode_attention
from dart_infer.target.kernels import load_kernels

MIN = torch.finfo(torch.float32).min


def cache_views(kv_heads: int, keys: int, dim: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value [1, kv_heads, keys, dim] as a cache with spare room holds them: strided views."""
    room = torch.randn(2, 1, kv_heads, keys + 37, dim, generator=generator)
    return room[0, :, :, :keys], room[1, :, :, :keys]


@pytest.mark.parametrize(("kv_heads", "groups", "dim"), [(3, 3, 64), (2, 1, 128), (1, 2, 72)])
@pytest.mark.parametrize("keys", [1, 7, 130, 300])
def test_kernel_matches_sdpa_on_a_tree_mask(kv_heads: int, groups: int, dim: int, keys: int) -> None:
    load_kernels()
    generator = torch.Generator().manual_seed(keys + dim)
    key, value = cache_views(kv_heads, keys, dim, generator)
    for rows in (1, 2, 5, 13):
        rows = min(rows, keys)
        query = torch.randn(1, kv_heads * groups, rows, dim, generator=generator)
        visible = torch.ones(rows, keys, dtype=torch.bool)
        visible[:, keys - rows:] = torch.rand(rows, rows, generator=generator) < 0.5  # a tree over the newest keys
        visible[:, keys - rows:].fill_diagonal_(True)
        mask = torch.zeros(rows, keys).masked_fill_(~visible, MIN)
        expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
        packed = query.reshape(1, kv_heads, groups * rows, dim)
        out = torch.ops.dart.decode_attention(packed, key, value, mask, 0.3).reshape(1, kv_heads * groups, rows, dim)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_row_gets_the_same_bits_whatever_shares_the_call() -> None:
    """A tree's node gets what a one-row step at its place would: the other rows, and keys masked out
    for it (its siblings), change nothing in its result, bit for bit."""
    load_kernels()
    generator = torch.Generator().manual_seed(0)
    key, value = cache_views(3, 420, 64, generator)
    query = torch.randn(1, 3, 12, 64, generator=generator)
    for past in (5, 127, 128, 300):  # the one-row step over `past + 1` keys, none masked
        alone = torch.ops.dart.decode_attention(query[:, :, :1], key[:, :, :past + 1], value[:, :, :past + 1], None, 0.125)
        for extra, masked in ((0, 0.0), (7, MIN), (119, float("-inf"))):  # then with `extra` keys masked out after it
            mask = torch.zeros(4, past + 1 + extra)
            mask[:, past + 1:] = masked
            mask[1:] = torch.randn(3, past + 1 + extra, generator=generator)  # other rows: anything
            together = torch.ops.dart.decode_attention(
                query, key[:, :, :past + 1 + extra], value[:, :, :past + 1 + extra], mask, 0.125)
            assert torch.equal(together[:, :, 0], alone[:, :, 0]), (past, extra)


def test_anything_else_runs_sdpa() -> None:
    """A prompt (several rows, no mask), batches and bfloat16 go to SDPA (through packed GQA), unchanged."""
    base, _ = tiny_pair("llama")
    module = base.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(1)
    for shape, dtype in (((1, 4, 9, 16), torch.float32), ((2, 4, 1, 16), torch.float32), ((1, 4, 1, 16), torch.bfloat16)):
        query = torch.randn(shape, generator=generator).to(dtype)
        key = torch.randn(shape[0], 2, shape[2], 16, generator=generator).to(dtype)
        value = torch.randn(shape[0], 2, shape[2], 16, generator=generator).to(dtype)
        out, _ = decode_kernel_attention(module, query, key, value, None, scaling=0.25)
        expected = F.scaled_dot_product_attention(query, key, value, is_causal=shape[2] > 1, scale=0.25,
                                                  enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_dart_and_ar_through_the_kernel_equal_generate(kind: str) -> None:
    """A model on the kernel (as served with bf16 weights): `generate` on it runs the kernel too, and greedy
    DART and AR give its tokens, across trees of every shape the tiny head proposes."""
    base, head = tiny_pair(kind, draft_vocab_size=40)
    use_decode_attention(base)
    assert base.config._attn_implementation == DECODE_KERNEL
    model = DartModel(base, head, tree=TreeSearchSettings(draft_top_k=8, beam_width=6, remain_total=12))
    for i in range(3):
        prompt = torch.randint(3, 48, (1, 4 + 60 * i), generator=torch.Generator().manual_seed(i))
        expected = reference(base, prompt, 32)
        assert torch.equal(model.dart_generate(prompt, max_new_token_num=32), expected), i
        assert torch.equal(model.ar_generate(prompt, max_new_token_num=32), expected), i
