"""The compiled target (`dart_infer.target.compiled`): static cache, fixed-shape frozen inductor steps.
Lossless like the eager adapter (fp32 greedy DART and AR equal `generate`), across cache growth and
keep-path gathers, with no recompilation from one request to the next; one-line refusals otherwise."""

from __future__ import annotations

import pytest
import torch
from helpers import reference, tiny_pair

from dart_infer import DartModel, TreeSearchSettings, compile_decoding
from dart_infer.target.adapter import TargetModel
from dart_infer.target.compiled import GEMM_ENV, CompiledTarget, gemm_options, inductor_settings

WIDE = TreeSearchSettings(draft_top_k=48, beam_width=20, remain_total=40)
pytestmark = pytest.mark.slow  # each test compiles graphs: 30-70 s on 2 cores


def test_compiled_greedy_equals_generate_through_growth_and_reuse(monkeypatch) -> None:
    monkeypatch.setenv(GEMM_ENV, "onednn")  # the template's steps: test_cpp_template_gemms_are_lossless
    torch.set_num_threads(1)
    base, head = tiny_pair("qwen3", draft_vocab_size=40)
    model = compile_decoding(DartModel(base, head, tree=WIDE), capacity=64)
    target = model.target
    assert isinstance(target, CompiledTarget) and target.tree_sizes == (41,)
    accepted = 0
    for i in range(4):
        # Prompt lengths 3..243: the last ones outgrow the 256-position cache (it doubles, contents kept).
        prompt = torch.randint(3, 48, (1, 3 + 80 * i), generator=torch.Generator().manual_seed(i))
        expected = reference(base, prompt, 40)
        out, stats = model.dart_generate(prompt, max_new_token_num=40, return_stats=True)
        assert torch.equal(out, expected), i
        assert torch.equal(model.ar_generate(prompt, max_new_token_num=40), expected), i
        accepted += sum(stats.accept_lengths)
    assert target.capacity == 512 and accepted > 0
    # A second round of the same sizes reuses the compiled graphs: nothing is compiled again.
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for i in range(2):
        prompt = torch.randint(3, 48, (1, 5 + i), generator=torch.Generator().manual_seed(10 + i))
        assert torch.equal(model.dart_generate(prompt, max_new_token_num=24), reference(base, prompt, 24))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_compiled_decoding_refuses_what_it_cannot_run(monkeypatch) -> None:
    monkeypatch.setenv(GEMM_ENV, "onednn")  # sizes and refusals here, whatever the GEMMs (the template compiles slower)
    base, head = tiny_pair("gemma3")
    for background in (False, True):  # refused at once, not in the compiling thread
        with pytest.raises(ValueError, match="sliding-window"):
            compile_decoding(DartModel(base, head), background=background)
    base, head = tiny_pair("llama")
    target = CompiledTarget(base, head.config.aux_layer_ids, tree_sizes=(2, 4))
    cache = target.prefill(torch.tensor([[3, 4, 5]]))[2]
    eager = TargetModel(base, head.config.aux_layer_ids)
    for n in (2, 3):  # padded to 2 and to 4 nodes: the rows of a tree are the eager adapter's
        chain, depth, mask = torch.arange(6, 6 + n), torch.arange(n), torch.tril(torch.ones(n, n, dtype=torch.bool))
        eager_cache = eager.prefill(torch.tensor([[3, 4, 5]]))[2]
        expected = eager.verify(chain, depth, mask, eager_cache)[1]
        assert torch.allclose(target.verify(chain, depth, mask, cache)[1], expected, atol=1e-4)
        target.keep_path(cache, 3, [])
    # A fit over many sizes (one graph each, per cache capacity) stays under dynamo's recompile limit.
    CompiledTarget(base, head.config.aux_layer_ids, tree_sizes=range(2, 14))
    assert torch._dynamo.config.recompile_limit >= 6 * 12 + 8
    tree = torch.arange(6)
    with pytest.raises(ValueError, match="does not fit the compiled tree size 4"):
        target.verify(tree, torch.zeros(6, dtype=torch.long), torch.eye(6, dtype=torch.bool), cache)


def test_fit_tree_on_the_compiled_step_verifies_each_setting_at_its_own_size(monkeypatch) -> None:
    """`dart-eval action=fit_tree compile=true`: the compiled target gets each setting's tree sizes, so a
    setting is timed padded to its own size (not the grid's largest), and the fit stays lossless."""
    from dart_infer.evaluation.tree_fit import fit_tree, tree_sizes

    monkeypatch.setenv(GEMM_ENV, "onednn")  # sizes, whatever the GEMMs (the template compiles slower)

    torch.set_num_threads(1)
    base, head = tiny_pair("llama", draft_vocab_size=40)
    # Two sizes (each one more graph to compile): the kept nodes (3), and those plus a copy span (7).
    grid = [{"remain_total": 2, "copy_span_tokens": 0}, {"remain_total": 2, "copy_span_tokens": 4}]
    model = DartModel(base, head, tree=TreeSearchSettings(draft_top_k=8, beam_width=4, remain_total=6))
    assert tree_sizes(model, grid) == (3, 7)
    compile_decoding(model, tree_sizes=tree_sizes(model, grid), capacity=64)
    prompts = [torch.randint(3, 48, (1, 6 + i), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    results = fit_tree(model, prompts, grid, max_new_tokens=16)
    assert sorted(r["copy_span_tokens"] for r in results) == [0, 4]
    for row in results:
        assert row["tree_nodes"] <= 1 + row["remain_total"] + row["copy_span_tokens"] and row["tau"] >= 1
    for ids in prompts:
        assert torch.equal(model.dart_generate(ids, max_new_token_num=16, tree=grid[1]), reference(base, ids, 16))


def test_compiled_draft_step_gives_the_eager_steps_logits() -> None:
    """`CompiledDraftStep`: padded rows, explicit cache slots and a window give the eager draft step's
    logits step after step (prompt eagerly, 1..max_new new positions compiled, longer ones eagerly)."""
    from dart_infer.methods.dart.compiled_draft import CompiledDraftStep
    from dart_infer.methods.draft_head import DraftKVCache

    torch.set_num_threads(1)
    base, head = tiny_pair("llama", draft_vocab_size=40)
    head = DartModel(base, head).draft_model  # the target's embedding attached
    step = CompiledDraftStep(head, max_new=4, capacity=16)
    compiled_cache, eager_cache = step.new_cache(), DraftKVCache()
    generator = torch.Generator().manual_seed(0)
    for n in (7, 1, 3, 4, 2, 6, 1, 4):  # 6 > max_new: eager through the same cache; 16 slots outgrown
        aux = torch.randn(1, n, 3 * head.config.target_hidden_size, generator=generator)
        ids = torch.randint(3, 48, (1, n), generator=generator)
        ours, expected = step(aux, ids, compiled_cache), head.draft_step(aux, ids, eager_cache)
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
        assert compiled_cache.length == eager_cache.length
    assert compiled_cache.capacity == 32


def test_background_compile_serves_eagerly_then_compiled_without_recompiling() -> None:
    """`compile_decoding(background=True)` returns before compiling: requests decode eagerly (and
    losslessly) while a thread compiles, then through the compiled steps; a request under
    `torch.inference_mode()` or `torch.no_grad()` compiles nothing more (inference tensors' dispatch
    keys once made every graph compile again, minutes on a 2-core CPU)."""
    torch.set_num_threads(1)
    base, head = tiny_pair("llama", draft_vocab_size=40)
    model = compile_decoding(DartModel(base, head, tree=TreeSearchSettings(remain_total=6)), capacity=64,
                             background=True)
    assert not isinstance(model.target, CompiledTarget) and not model.compiling.done
    prompt = torch.randint(3, 48, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = reference(base, prompt, 24)
    assert torch.equal(model.dart_generate(prompt, max_new_token_num=24), expected)  # eager, beside the compiler
    assert model.compiling.wait(timeout=600) and model.compiling.error is None
    assert isinstance(model.target, CompiledTarget) and model.compiled_draft is not None
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            assert torch.equal(model.dart_generate(prompt, max_new_token_num=24), expected), mode
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_frozen_fp32_linears_run_on_onednn_not_mkl() -> None:
    """fp32 linears are packed for oneDNN (inductor's default for fp32 is MKL's packed sgemm, ~1.3-2x
    slower per step on the 2-core EPYCs), and give the eager linear's output."""
    from torch._inductor.utils import run_and_get_code

    inductor_settings()
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.SiLU(), torch.nn.Linear(96, 32)).eval()
    x = torch.randn(5, 64)
    with torch.no_grad():
        out, (code, *_) = run_and_get_code(torch.compile(layer), x)
        torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-5)
    assert "mkldnn._linear_pointwise" in code and "_mkl_linear" not in code


@pytest.mark.parametrize(("avx512", "amx", "plain", "tree"), [
    (False, False, "cpp", "cpp"),  # AVX2-only CPUs
    (True, False, "cpp", "onednn"),  # AVX-512 without AMX (the EPYC)
    (True, True, "onednn", "onednn"),  # AMX (Xeon): not measured with the template
])
def test_gemm_options_follow_the_machine_kind(monkeypatch, avx512, amx, plain, tree) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.delenv(GEMM_ENV, raising=False)
    for step, expected in (("plain", plain), ("tree", tree)):
        assert bool(gemm_options(step)) == (expected == "cpp"), step
    monkeypatch.setenv(GEMM_ENV, "onednn")
    assert gemm_options("plain") == {}
    monkeypatch.setenv(GEMM_ENV, "mkl")
    with pytest.raises(ValueError, match="auto, cpp or onednn"):
        gemm_options("plain")


def test_cpp_template_gemms_are_lossless(monkeypatch) -> None:
    """The AVX2 machines' path on any CPU: every compiled step's GEMMs through inductor's C++ template
    (its micro-kernels in the generated code), fp32 greedy DART and AR still equal `generate`."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv(GEMM_ENV, "cpp")
    inductor_settings()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.SiLU(), torch.nn.Linear(96, 32)).eval()
    x = torch.randn(5, 64)
    with torch.no_grad():
        out, (code, *_) = run_and_get_code(torch.compile(layer, options=gemm_options("tree")), x)
    torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-5)
    assert "kernel_micro_gemm" in code and "_linear_pointwise" not in code
    base, head = tiny_pair("llama", draft_vocab_size=40)
    model = compile_decoding(DartModel(base, head, tree=TreeSearchSettings(remain_total=6)), capacity=64, plain=True)
    for i in range(2):  # the plain, tree and draft steps
        prompt = torch.randint(3, 48, (1, 5 + 30 * i), generator=torch.Generator().manual_seed(i))
        expected = reference(base, prompt, 24)
        assert torch.equal(model.dart_generate(prompt, max_new_token_num=24), expected), i
        assert torch.equal(model.ar_generate(prompt, max_new_token_num=24), expected), i
