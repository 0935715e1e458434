"""bf16 weights with fp32 compute (`dart_infer.target.bf16_weights`, the C++ kernel in
dart_infer/csrc/kernels/bf16_weight_linear.cpp): the products of the bf16-rounded weight, each row's
result independent of the rows beside it, and greedy decoding through it still lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import reference, tiny_pair
from torch import nn

from dart_infer import DartModel, TreeSearchSettings
from dart_infer.target.bf16_weights import (
    MAX_KERNEL_ROWS,
    Bf16WeightLinear,
    use_bf16_weights,
    uses_bf16_weights,
)
from dart_infer.target.kernels import load_kernels


@pytest.mark.parametrize(("out_features", "in_features"), [(16, 8), (48, 37), (96, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_the_linear_of_the_rounded_weight(out_features: int, in_features: int, bias: bool) -> None:
    load_kernels()
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    packed = torch.ops.dart.bf16_weight_pack(weight)
    assert packed.dtype == torch.bfloat16 and packed.shape == (out_features // 16, in_features, 16)
    rounded = weight.to(torch.bfloat16).float()
    x = torch.randn(2, 7, in_features, generator=generator)  # any leading shape: 14 rows
    out = torch.ops.dart.bf16_weight_linear(x, packed, b)
    assert out.shape == (2, 7, out_features)
    torch.testing.assert_close(out, F.linear(x, rounded, b), rtol=1e-5, atol=1e-5 * in_features**0.5)
    # A row's result is the same bits whatever rows share the call (one token vs a verified tree).
    rows = x.reshape(14, in_features)
    for count in (1, 2, 5, 6, 7, 8, 13, 14):  # 7, 8, 13, 14: the rows left after blocks of 6
        together = torch.ops.dart.bf16_weight_linear(rows[:count], packed, b)
        alone = torch.cat([torch.ops.dart.bf16_weight_linear(rows[i : i + 1], packed, b) for i in range(count)])
        assert torch.equal(together, alone), count


def test_kernel_refuses_what_it_cannot_multiply() -> None:
    load_kernels()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.dart.bf16_weight_pack(torch.randn(20, 8))
    packed = torch.ops.dart.bf16_weight_pack(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="float32 input"):
        torch.ops.dart.bf16_weight_linear(torch.randn(1, 8, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="has 9 features"):
        torch.ops.dart.bf16_weight_linear(torch.randn(1, 9), packed, None)


def test_module_rounds_in_place_and_takes_the_onednn_copy_for_prompts() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 32)
    original = linear.weight.detach().clone()
    module = Bf16WeightLinear(linear)
    assert torch.equal(module.weight, original.to(torch.bfloat16).float())  # rounded, still float32
    assert module.weight is linear.weight  # a tied embedding sees the same rounding
    few, many = torch.randn(3, 24), torch.randn(1, MAX_KERNEL_ROWS + 1, 24)
    torch.testing.assert_close(module(few), F.linear(few, module.weight, module.bias))
    with torch.profiler.profile() as profile:
        out = module(many)
    torch.testing.assert_close(out, F.linear(many, module.weight, module.bias))
    ran = {event.name for event in profile.events()}
    assert "mkldnn::_linear_pointwise" in ran and "dart::bf16_weight_linear" not in ran  # the prompt's oneDNN copy


@pytest.mark.parametrize("tree", [TreeSearchSettings(draft_top_k=4, beam_width=4, remain_total=8),
                                  TreeSearchSettings(draft_top_k=1, beam_width=1, remain_total=1)], ids=["tree", "one"])
def test_greedy_dart_through_bf16_weights_is_lossless(tree: TreeSearchSettings) -> None:
    base, head = tiny_pair("llama")
    use_bf16_weights(base)
    assert uses_bf16_weights(base) and isinstance(base.lm_head, Bf16WeightLinear)
    model = DartModel(base, head, tree=tree)
    for i in range(5):  # prompts of 3 to 123 tokens: the kernel's rows and the prompt's oneDNN GEMM
        prompt = torch.randint(3, 48, (1, 3 + 30 * i), generator=torch.Generator().manual_seed(i))
        expected = reference(base, prompt, 32)  # transformers' generate on the same (rounded) model
        assert torch.equal(model.dart_generate(prompt, max_new_token_num=32), expected), i
        assert torch.equal(model.ar_generate(prompt, max_new_token_num=32), expected), i


def test_only_float32_cpu_models() -> None:
    base, _ = tiny_pair("llama")
    with pytest.raises(ValueError, match="float32 models on a CPU"):
        use_bf16_weights(base.to(torch.bfloat16))


def test_from_pretrained_and_dart_eval_serve_bf16_weights(tiny_dart, tmp_path) -> None:
    import json

    from helpers import run_dart_eval

    _, root = tiny_dart
    model = DartModel.from_pretrained(str(root / "base"), str(root / "head"), bf16_weights=True)
    assert uses_bf16_weights(model.base_model) and uses_bf16_weights(model.draft_model)
    with pytest.raises(ValueError, match="cannot be cast"):
        model.with_dtype(torch.bfloat16)
    plain = DartModel.from_pretrained(str(root / "base"), str(root / "head"), bf16_weights="auto")  # dtype not auto
    assert not uses_bf16_weights(plain.base_model)
    result = run_dart_eval(
        "model=custom", f"model.name_or_path={root / 'base'}", f"draft_model={root / 'head'}",
        f"ngram_model={root / 'tiny.trie'}", "benchmarks=[mtbench]", "limit=2", "max_new_tokens=8", "temperature=0",
        "baseline_dtypes=[]", "methods=[ar,hf_generate,dart]", "bf16_weights=true", f"out_dir={tmp_path / 'out'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| mtbench | T=0 | dart | float32 (bf16 weights) |" in result.stdout
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["meta"]["serving_dtype"] == "float32 (bf16 weights)"
    rows = saved["summary"]["mtbench"]["T=0"]
    assert rows["dart"]["identical_to_ar"] == 1.0
    assert rows["dart"]["identical_to_fp32"] is None  # the float32 reference is plain float32, not run here


def test_bf16_weight_rows_are_compared_with_vllm_in_float32() -> None:
    from dart_infer.evaluation.records import Record
    from dart_infer.evaluation.results import summarize

    def record(method: str, dtype: str, seconds: float) -> Record:
        return Record(benchmark="b", prompt_id="p", turn=0, method=method, prompt_tokens=4, new_tokens=10,
                      seconds=seconds, dtype=dtype, label=method)

    rows = summarize([record("ar", "float32 (bf16 weights)", 1.0), record("dart", "float32 (bf16 weights)", 0.5),
                      record("vllm", "float32", 2.0)], draft_length=4)["b"]["T=0"]
    assert rows["dart"]["speedup_vs_vllm"] == pytest.approx(4.0) and rows["dart"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert "speedup_vs_ar" not in rows["vllm"]  # plain float32 has no float32 (bf16 weights) ar beside it
