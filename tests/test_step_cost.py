"""Fixed-cost work of a decoding step: in-place cache appends, the cheap keep-path, weight layouts.

Each change must leave every number where it was: the same logits/cache contents as transformers'
own cache and layout (bitwise where the kernels allow, fp32 greedy output identical to `generate`).
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from torch import nn
from transformers.cache_utils import DynamicCache

from dart_infer import DartDraftConfig, DartDraftModel, DartModel
from dart_infer.target.adapter import TargetModel
from dart_infer.target.step_cost import GrowingLayer, use_fast_matmul_layout

# tiny_llama fields; initializer_range 0.3: peaked random logits, no near-ties for fp32 rounding to decide.
CONFIG = dict(vocab_size=97, head_dim=8, max_position_embeddings=1024, initializer_range=0.3,
              attn_implementation="sdpa")


def tiny(seed: int = 0):
    return tiny_llama(seed, **CONFIG)


def test_growing_cache_gives_the_same_numbers_as_transformers_cache() -> None:
    model = tiny()
    target = TargetModel(model)
    cache = target.new_cache()
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    reference = DynamicCache(config=model.config)
    prompt = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(1))
    ours, _ = target.next_logits(prompt, cache)
    theirs, _ = target.next_logits(prompt, reference)
    assert torch.equal(ours, theirs)
    buffer = cache.layers[0]._key_buffer
    # 200 + 150 tokens one by one: the first buffer (capacity 400) takes them all without a copy,
    # then it grows once, and the contents stay equal to transformers' concatenated cache.
    for step in range(150):
        token = torch.tensor([[step % 97]])
        ours, _ = target.next_logits(token, cache)
        theirs, _ = target.next_logits(token, reference)
        assert torch.equal(ours, theirs), step
    assert cache.layers[0]._key_buffer is buffer  # 350 entries fit in the first buffer (2 x 200)
    for token in range(60):  # past 400: the buffer doubles, contents carried over
        ours, _ = target.next_logits(torch.tensor([[token]]), cache)
        theirs, _ = target.next_logits(torch.tensor([[token]]), reference)
    assert cache.layers[0]._key_buffer is not buffer and cache.layers[0]._key_buffer.shape[-2] >= 410
    assert torch.equal(ours, theirs)
    for mine, hf in zip(cache.layers, reference.layers, strict=True):
        assert torch.equal(mine.keys, hf.keys) and torch.equal(mine.values, hf.values)


def test_keep_path_then_append_reuses_the_room_and_matches_a_recomputed_prefix() -> None:
    model = tiny()
    target = TargetModel(model)
    prompt = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(2))
    _, _, cache = target.prefill(prompt[None])
    tokens = torch.tensor([5, 6, 7, 8, 9])
    parents = [-1, 0, 0, 1, 3]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for node in range(5):
        walk = node
        while walk >= 0:
            mask[node, walk] = True
            walk = parents[walk]
    depth = mask.sum(1) - 1
    for keep in ([0, 1, 3, 4], [0, 2], [0]):  # a gathered path, a second branch, the in-place root only
        _, _, fresh = target.prefill(prompt[None])
        target.verify(tokens, depth, mask, fresh)
        buffer = fresh.layers[0]._key_buffer
        target.keep_path(fresh, 12, keep)
        _, reference = target.next_logits(torch.cat([prompt, tokens[keep]])[None], DynamicCache(config=model.config))
        for mine, hf in zip(fresh.layers, reference.layers, strict=True):
            assert (mine.keys - hf.keys).abs().max() < 1e-4 and (mine.values - hf.values).abs().max() < 1e-4, (
                (mine.keys - hf.keys).abs().max(), keep)
        logits, _ = target.next_logits(torch.tensor([[11]]), fresh)
        expected = model(torch.cat([prompt, tokens[keep], torch.tensor([11])])[None]).logits[0, -1]
        assert torch.allclose(logits, expected, atol=1e-5), keep
        assert fresh.layers[0]._key_buffer is buffer  # the dropped nodes' room was reused in place
    with pytest.raises(IndexError):
        target.keep_path(cache, 12, [0, 1])  # nothing verified beyond the prompt


def test_fast_layout_is_column_major_for_cpu_float32_only_and_keeps_values() -> None:
    model = tiny()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    prompt = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    expected = model.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert use_fast_matmul_layout(model) == len(linears)
    assert all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    assert use_fast_matmul_layout(model) == 0  # idempotent
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert torch.equal(model.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=0), expected)
    model.to(torch.bfloat16)  # .to keeps strides; the bf16 kernels want row-major back
    assert use_fast_matmul_layout(model) == len(linears)
    assert all(m.weight.is_contiguous() for m in linears)


def test_dart_model_lays_out_target_and_head_and_relayouts_after_a_move() -> None:
    base = tiny()
    head = DartDraftModel(DartDraftConfig.from_target_config(base.config, draft_length=4))
    model = DartModel(base, head.eval())
    for module in (base.model.layers[0].mlp.gate_proj, base.lm_head, head.lm_head, head.fc):
        assert module.weight.t().is_contiguous()
    # The head still shares the target's embedding storage after the re-layout.
    assert head.embed_tokens.weight.data_ptr() == base.get_input_embeddings().weight.data_ptr()
    model.to(torch.bfloat16)
    assert base.lm_head.weight.is_contiguous() and head.lm_head.weight.is_contiguous()
    assert head.embed_tokens.weight.data_ptr() == base.get_input_embeddings().weight.data_ptr()
