"""dart-eval on a tiny random target with the real SmolLM2 tokenizer: methods, metrics, files, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dart_infer import DartDraftConfig, DartDraftModel, DartModel
from dart_infer.assets import tokenizer_fingerprint
from dart_infer.conversations import load_conversations
from dart_infer.evaluate import (
    METHODS,
    EvalSettings,
    Evaluator,
    chat_prompt,
    fit_tree,
    save_results,
    summarize,
)
from ngram_builder import NgramTrie

VOCAB = 49152  # SmolLM2's tokenizer drives the chat template, so the tiny target shares its vocabulary


@pytest.fixture(scope="module")
def tiny_dart(smollm2_tokenizer, tmp_path_factory) -> tuple[DartModel, Path]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=2048, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa",
    )
    base = LlamaForCausalLM(config).eval()
    head = DartDraftModel(DartDraftConfig.from_target_config(config, draft_length=4, draft_vocab_size=4096)).eval()
    head.set_vocab_mapping(torch.arange(4096))
    # A trie of the tiny model's own greedy continuations: the n-gram term then has real signal.
    trie = NgramTrie(order=3, vocab_size=VOCAB)
    for conversation in load_conversations("mtbench", limit=4):
        ids = chat_prompt(smollm2_tokenizer, conversation.messages[:1])
        out = base.generate(ids[None], do_sample=False, max_new_tokens=24, pad_token_id=2)
        trie.add_tokens(out[0].tolist() + [2])
    trie.tokenizer_fingerprint = tokenizer_fingerprint(smollm2_tokenizer)
    root = tmp_path_factory.mktemp("tiny_dart")
    base.save_pretrained(root / "base")
    smollm2_tokenizer.save_pretrained(root / "base")
    head.save_pretrained(root / "head")
    trie.save(root / "tiny.trie")
    model = DartModel(base, head, smollm2_tokenizer, trie, tree={"draft_top_k": 8, "beam_width": 4, "remain_total": 8})
    return model, root


def test_every_method_on_two_turns(tiny_dart, tmp_path: Path) -> None:
    model, _ = tiny_dart
    evaluator = Evaluator(model, EvalSettings(methods=METHODS, max_new_tokens=12, multi_turn=True))
    evaluator.warm_up()
    conversations = load_conversations("mtbench", limit=2)
    records = evaluator.run("mtbench", conversations, progress=False)
    assert len(records) == 2 * 2 * len(METHODS)
    assert {(r.prompt_id, r.turn) for r in records} == {(c.id, t) for c in conversations for t in (0, 1)}
    # The second turn's prompt holds the first answer, so it is longer than the first.
    first, second = (next(r for r in records if r.method == "ar" and r.turn == t) for t in (0, 1))
    assert second.prompt_tokens > first.prompt_tokens + first.new_tokens
    for record in records:
        assert record.new_tokens > 0 and record.seconds > 0
        if record.method in ("hf_generate", "dart", "dart_no_trie"):
            assert record.identical_to_ar, record.method  # greedy fp32: lossless

    summary = summarize(records, draft_length=4)
    rows = summary["mtbench"]
    assert set(rows) == set(METHODS)
    assert rows["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    for method in ("dart", "dart_no_trie"):
        assert 1.0 <= rows[method]["tau"] <= 5.0
        assert len(rows[method]["acceptance_by_position"]) == 4
        assert sum(rows[method]["accept_length_histogram"]) == sum(r.steps for r in records if r.method == method)
        assert {"draft", "search", "verify"} <= set(rows[method]["time_split"])
    assert rows["ar"]["tau"] is None and rows["prompt_lookup"]["tau"] is None

    paths = save_results(tmp_path, records, summary, {"note": "test"})
    saved = json.loads(paths["json"].read_text())
    assert saved["summary"]["mtbench"]["dart"]["tau"] == rows["dart"]["tau"]
    assert len(saved["records"]) == len(records)
    assert "| mtbench | dart |" in paths["markdown"].read_text()
    for key in ("speedup_plot", "acceptance_plot", "time_plot"):
        assert paths[key].read_bytes()[:4] == b"\x89PNG"


def test_fit_tree_ranks_settings_by_measured_speedup(tiny_dart) -> None:
    model, _ = tiny_dart
    prompts = [chat_prompt(model.tokenizer, c.messages[:1]) for c in load_conversations("humaneval", limit=1)]
    grid = [{"draft_top_k": 4, "beam_width": 2, "remain_total": 2}, {"draft_top_k": 8, "beam_width": 4, "remain_total": 8}]
    results = fit_tree(model, prompts, grid, max_new_tokens=8)
    assert len(results) == 2
    assert results[0]["speedup_vs_ar"] >= results[1]["speedup_vs_ar"]
    assert all(r["tau"] >= 1.0 for r in results)


def test_bad_settings_fail_before_any_work(tiny_dart) -> None:
    model, _ = tiny_dart
    with pytest.raises(ValueError, match="unknown method"):
        EvalSettings(methods=["ar", "medusa"])
    with pytest.raises(ValueError, match="baseline"):
        EvalSettings(methods=["dart"])
    no_trie = DartModel(model.base_model, model.draft_model, model.tokenizer, None)
    with pytest.raises(ValueError, match="needs an n-gram trie"):
        Evaluator(no_trie, EvalSettings(methods=["ar", "dart"]))


def _dart_eval(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = str(Path(sys.executable).parent / "dart-eval")
    return subprocess.run([script, *args], capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={**os.environ, "HYDRA_FULL_ERROR": "1"})


def test_cli_end_to_end(tiny_dart, tmp_path: Path) -> None:
    _, root = tiny_dart
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Write a limerick about CPUs."}\nnot json\n')
    result = _dart_eval(
        "model=custom", f"model.name_or_path={root / 'base'}", f"draft_model={root / 'head'}",
        f"ngram_model={root / 'tiny.trie'}", f"benchmarks=[humaneval,{prompts}]", "limit=1", "max_new_tokens=8",
        f"out_dir={tmp_path / 'out'}", "tree.remain_total=4", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| humaneval | dart |" in result.stdout
    summary = json.loads((tmp_path / "out" / "results.json").read_text())["summary"]
    assert set(summary) == {"humaneval", str(prompts)}
    assert summary["humaneval"]["dart"]["identical_to_ar"] == 1.0
    assert "skipped 1 malformed" in result.stderr


def test_cli_rejects_unknown_benchmark_before_loading(tiny_dart, tmp_path: Path) -> None:
    _, root = tiny_dart
    result = _dart_eval(f"draft_model={root / 'head'}", "benchmarks=[nosuchbench]", cwd=tmp_path)
    assert result.returncode != 0
    assert "Unknown conversation source 'nosuchbench'" in result.stderr
