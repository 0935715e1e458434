"""dart-eval's `vllm` method: vLLM's plain decoding timed on the same prompts as our methods, in its own
venv and process (`vllm` marker: needs .venv-vllm from `make vllm`; fails, never skips, without it)."""

from __future__ import annotations

import pytest

from dart_infer.data.conversations import Conversation
from dart_infer.decoding.dart_model import DartModel
from dart_infer.engines.vllm.runner import VllmRunner
from dart_infer.evaluation.evaluate import EvalSettings, Evaluator
from dart_infer.evaluation.results import markdown_table, summarize

pytestmark = pytest.mark.vllm


def test_vllm_plain_runs_beside_our_methods_with_the_same_greedy_tokens(vllm_target_dir) -> None:
    """fp32 greedy: vLLM's tokens equal our AR's token for token (both lossless plain decoding of the
    same weights), and the table gains vLLM's tokens/s and the × vLLM column."""
    model = DartModel.from_pretrained(str(vllm_target_dir), None, dtype="float32")
    model.base_model.generation_config.eos_token_id = None
    settings = EvalSettings(methods=["ar", "vllm"], max_new_tokens=24, threads=1, warmup_tokens=4)
    conversations = [Conversation(id=str(i), messages=[{"role": "user", "content": text}], source="test")
                     for i, text in enumerate(["Name three rivers.", "def add(a, b):"])]
    with VllmRunner(vllm_target_dir, "float32", enforce_eager=True, max_model_len=512) as vllm:
        evaluator = Evaluator(model, settings, vllm={"vllm": vllm})
        evaluator.warm_up()
        records = evaluator.run("tiny", conversations, progress=False)
        # Each vLLM request was waited out (its worker busy-polls after one): its processes are idle now.
        assert vllm.wait_idle(max_seconds=1.0) < 0.5
    by_method = {m: [r for r in records if r.method == m] for m in ("ar", "vllm")}
    assert len(by_method["vllm"]) == 2 and all(r.seconds > 0 for r in by_method["vllm"])
    for ours, theirs in zip(by_method["ar"], by_method["vllm"], strict=True):
        assert theirs.output_ids == ours.output_ids and theirs.identical_to_ar
    row = summarize(records, 0)["tiny"]["T=0"]["ar"]
    assert row["speedup_vs_vllm"] == pytest.approx(
        row["tokens_per_second"] / summarize(records, 0)["tiny"]["T=0"]["vllm"]["tokens_per_second"])
    assert "× vLLM (same dtype)" in markdown_table(summarize(records, 0))


def test_vllm_prompt_lookup_counts_every_step_like_ours(vllm_target_dir) -> None:
    """vLLM's n-gram drafts: lossless (fp32 greedy = our AR), and its τ counts every target forward,
    also the steps where the lookup proposed nothing (vLLM's own counters skip those)."""
    model = DartModel.from_pretrained(str(vllm_target_dir), None, dtype="float32")
    model.base_model.generation_config.eos_token_id = None
    settings = EvalSettings(methods=["ar", "vllm_ngram"], max_new_tokens=48, threads=1, warmup_tokens=4)
    # Repetitive prompts: the random target's greedy text tends to loop, so the lookup finds drafts.
    conversations = [Conversation(id="0", messages=[{"role": "user", "content": "1 2 3 1 2 3 1 2 3"}], source="test")]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 2}
    with VllmRunner(vllm_target_dir, "float32", enforce_eager=True, max_model_len=512, speculative_config=spec) as vllm:
        records = Evaluator(model, settings, vllm={"vllm_ngram": vllm}).run("tiny", conversations, progress=False)
    ours, theirs = (next(r for r in records if r.method == m) for m in ("ar", "vllm_ngram"))
    assert theirs.output_ids == ours.output_ids
    # Every emitted token belongs to a counted step (the last step's drafts may overshoot the budget).
    assert theirs.new_tokens == 48 and 0 <= theirs.step_tokens - 48 <= spec["num_speculative_tokens"]
    assert theirs.steps == len(theirs.accept_lengths)


def test_a_missing_vllm_venv_is_one_line(tmp_path, monkeypatch) -> None:
    from dart_infer.common.errors import InputError

    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(InputError, match="make vllm"):
        VllmRunner(tmp_path, "float32")
