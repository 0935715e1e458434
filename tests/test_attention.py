"""Packed grouped-query attention (dart_infer.target.attention): the same numbers as transformers' SDPA
path without its copy of the cache, and scoped to our own target calls."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_gemma3_config, tiny_llama
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dart_infer.target.adapter import TargetModel
from dart_infer.target.attention import PACKED_GQA, packed_gqa, packed_gqa_attention


@pytest.mark.parametrize("rows", [1, 3, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_equals_transformers_sdpa(rows: int, dtype: torch.dtype) -> None:
    base = tiny_llama(num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    module = base.model.layers[0].self_attn
    assert module.num_key_value_groups == 3
    generator = torch.Generator().manual_seed(rows)
    keys = 57
    query = torch.randn(1, 6, rows, 8, generator=generator).to(dtype)
    key, value = (torch.randn(1, 2, keys, 8, generator=generator).to(dtype) for _ in range(2))
    visible = torch.rand(rows, keys, generator=generator) > 0.4
    visible[:, 0] = True  # every row sees something
    for mask in (visible[None, None], torch.zeros(1, 1, rows, keys, dtype=dtype).masked_fill(~visible, -1e4)):
        stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
        ours, _ = packed_gqa_attention(module, query, key, value, mask, scaling=module.scaling)
        assert ours.shape == stock.shape == (1, rows, 6, 8)
        torch.testing.assert_close(ours, stock, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=0)


def test_target_forwards_use_it_and_leave_the_model_as_it_was() -> None:
    """A tree verification through the adapter = the same model's on transformers' eager attention, and
    the caller's model keeps "sdpa" outside our calls."""
    base = tiny_llama()
    target = TargetModel(base)
    prompt = torch.randint(3, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([5, 7, 9, 11])
    positions = torch.tensor([0, 1, 1, 2])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    _, _, cache = target.prefill(prompt)
    _, logits = target.verify(tokens, positions, mask, cache)
    assert base.config._attn_implementation == "sdpa"

    eager = TargetModel(tiny_llama(attn_implementation="eager"))  # the same weights, no SDPA at all
    _, _, eager_cache = eager.prefill(prompt)
    _, eager_logits = eager.verify(tokens, positions, mask, eager_cache)
    torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=0)
    with packed_gqa(base):
        assert base.config._attn_implementation == PACKED_GQA
    assert base.config._attn_implementation == "sdpa"


def test_other_backends_and_sub_configs_are_left_alone() -> None:
    from transformers import Gemma3ForCausalLM

    eager = tiny_llama(attn_implementation="eager")
    with packed_gqa(eager):
        assert eager.config._attn_implementation == "eager"
    gemma = Gemma3ForCausalLM(tiny_gemma3_config()).eval()
    with packed_gqa(gemma):
        assert gemma.config.get_text_config()._attn_implementation == PACKED_GQA
    assert gemma.config._attn_implementation == "sdpa"


def test_overlapping_forwards_keep_it_until_the_last_one_leaves() -> None:
    """dart-app serves requests in threads on one model: one request's forward ending must not switch
    the attention under another's (which would also fail verify's back-end check)."""
    base = tiny_llama()
    first, second = packed_gqa(base), packed_gqa(base)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first request's forward ends while the second's runs
    assert base.config._attn_implementation == PACKED_GQA
    target = TargetModel(base)
    _, _, cache = target.prefill(torch.tensor([[3, 4, 5]]))
    target.verify(torch.tensor([6, 7]), torch.tensor([0, 1]), torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), cache)
    second.__exit__(None, None, None)
    assert base.config._attn_implementation == "sdpa"
