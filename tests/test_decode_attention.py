"""The decode-attention kernel (`torch.ops.dart.decode_attention`, dart_infer/csrc/kernels/decode_attention.cpp),
the prompt's (`torch.ops.dart.prefill_attention`, prefill_attention.cpp) and the attention implementation
around them (`dart_infer.target.attention.DECODE_KERNEL`): SDPA's result for a step's rows over a strided
cache, each row the same bits whatever rows or masked keys share the call, SDPA's causal result for a
prompt, and greedy decoding through them still lossless."""

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


@pytest.mark.parametrize(("kv_heads", "groups", "dim"), [(3, 3, 64), (2, 1, 128), (1, 2, 8), (2, 2, 72)])
@pytest.mark.parametrize("tokens", [2, 17, 48, 49, 130, 300])
def test_prefill_kernel_matches_causal_sdpa(kv_heads: int, groups: int, dim: int, tokens: int) -> None:
    """Laid out as transformers hands them over: the query a transposed view, the keys and values views of a
    cache with spare room; every query-block and key-block edge (48 rows, 64 keys, 16-key tiles) crossed."""
    load_kernels()
    generator = torch.Generator().manual_seed(tokens + dim)
    key, value = cache_views(kv_heads, tokens, dim, generator)
    query = torch.randn(1, tokens, kv_heads * groups, dim, generator=generator).transpose(1, 2)
    out = torch.ops.dart.prefill_attention(query, key, value, 0.3)
    expected = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_a_prompt_runs_the_prefill_kernel_and_anything_else_sdpa() -> None:
    """A causal prompt with nothing cached runs `prefill_attention`; batches, bfloat16, head sizes that are
    not a multiple of 16 and a prompt after a cache (a mask) go to SDPA (through packed GQA), unchanged."""
    base, _ = tiny_pair("llama")
    module = base.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(1)
    cases = (((1, 4, 9, 16), 9, torch.float32, True), ((2, 4, 1, 16), 1, torch.float32, False),
             ((1, 4, 1, 16), 1, torch.bfloat16, False), ((1, 4, 9, 12), 9, torch.float32, False),
             ((1, 4, 3, 16), 7, torch.float32, False))
    for shape, keys, dtype, kernel in cases:
        query = torch.randn(shape, generator=generator).to(dtype)
        key = torch.randn(shape[0], 2, keys, shape[3], generator=generator).to(dtype)
        value = torch.randn(shape[0], 2, keys, shape[3], generator=generator).to(dtype)
        mask = None
        if keys > shape[2]:  # rows after a cache: each sees the cache and the rows up to itself
            mask = torch.ones(shape[2], keys, dtype=torch.bool).tril(keys - shape[2])[None, None]
        with torch.profiler.profile() as profile:
            out, _ = decode_kernel_attention(module, query, key, value, mask, scaling=0.25)
        ran = {event.name for event in profile.events()}
        assert ("dart::prefill_attention" in ran) == kernel, shape
        expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None and shape[2] > 1,
                                                  scale=0.25, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out, expected)


def test_a_model_prompt_goes_through_the_prefill_kernel() -> None:
    """transformers leaves a fresh prompt's mask to is_causal, so a model on the kernel runs it there."""
    base, _ = tiny_pair("llama")
    use_decode_attention(base)
    prompt = torch.randint(3, 48, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.profiler.profile() as profile:
        base(prompt)
    ran = [event.name for event in profile.events()]
    assert ran.count("dart::prefill_attention") == base.config.num_hidden_layers


def test_prefill_kernel_refuses_what_it_cannot_compute() -> None:
    load_kernels()
    query, key = torch.randn(1, 4, 9, 12), torch.randn(1, 2, 9, 12)
    with pytest.raises(RuntimeError, match="head size must be a multiple of 8"):
        torch.ops.dart.prefill_attention(query, key, key, 0.2)
    with pytest.raises(RuntimeError, match="same T positions"):
        torch.ops.dart.prefill_attention(torch.randn(1, 4, 9, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16), 0.2)


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
