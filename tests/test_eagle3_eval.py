"""`dart-eval methods=[...,eagle3] eagle3_model=...`: EAGLE-3 timed next to DART on the same target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_dart_eval

from dart_infer.data.conversations import load_conversations
from dart_infer.evaluation.evaluate import EvalSettings, Evaluator
from dart_infer.methods.eagle3 import Eagle3DraftConfig, Eagle3DraftModel


@pytest.fixture(scope="module")
def eagle3_head(tiny_dart) -> Path:
    model, root = tiny_dart
    torch.manual_seed(3)
    head = Eagle3DraftModel(Eagle3DraftConfig.from_target_config(model.base_model.config, draft_vocab_size=4096))
    head.set_vocab_mapping(torch.arange(4096))
    head.save_pretrained(root / "eagle3")
    return root / "eagle3"


def test_evaluator_runs_eagle3_beside_dart(tiny_dart, eagle3_head) -> None:
    model, _ = tiny_dart
    from dart_infer.methods import load_head

    head, method = load_head(str(eagle3_head))
    assert method.name == "eagle3"
    eagle3 = model.with_head(head, tree={"top_k": 4, "depth": 3, "total_tokens": 8})
    settings = EvalSettings(methods=["ar", "dart", "eagle3"], max_new_tokens=10)
    records = Evaluator(model, settings, eagle3=eagle3).run("mtbench", load_conversations("mtbench", limit=2),
                                                           progress=False)
    ours = [r for r in records if r.method == "eagle3"]
    assert len(ours) == 2 and all(r.identical_to_ar for r in ours)
    assert all(r.steps and r.step_tokens == r.new_tokens - 1 for r in ours)
    with pytest.raises(ValueError, match="eagle3_model"):
        Evaluator(model, settings)
    with pytest.raises(ValueError, match="eagle3_model"):  # a DART head is not an EAGLE-3 one
        Evaluator(model, settings, eagle3=model)


def test_cli_eagle3_method(tiny_dart, eagle3_head, tmp_path: Path) -> None:
    _, root = tiny_dart
    result = run_dart_eval(
        "model=custom", f"model.name_or_path={root / 'base'}", f"draft_model={root / 'head'}",
        f"ngram_model={root / 'tiny.trie'}", "benchmarks=[mtbench]", "limit=1", "max_new_tokens=8",
        "methods=[ar,dart,eagle3]", f"eagle3_model={eagle3_head}", "eagle3_tree.total_tokens=6",
        f"out_dir={tmp_path / 'out'}", "temperature=0", "baseline_dtypes=[]", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| mtbench | T=0 | eagle3 | float32 |" in result.stdout
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["summary"]["mtbench"]["T=0"]["eagle3"]["identical_to_ar"] == 1.0
    assert saved["meta"]["eagle3_tree"] == {"top_k": 4, "depth": 5, "total_tokens": 6}  # CPU default + override


def test_fit_tree_measures_eagle3_tree_settings(tiny_dart, eagle3_head, tmp_path: Path) -> None:
    _, root = tiny_dart
    result = run_dart_eval(
        "action=fit_tree", "fit.method=eagle3", "model=custom", f"model.name_or_path={root / 'base'}",
        f"draft_model={root / 'head'}", f"eagle3_model={eagle3_head}", "fit.prompts=1", "fit.max_new_tokens=8",
        "fit.eagle3_grid.top_k=[2,4]", "fit.eagle3_grid.depth=[3]", "fit.eagle3_grid.total_tokens=[6]",
        f"out_dir={tmp_path / 'fit'}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eagle3_tree.top_k=" in result.stdout and "eagle3_tree.total_tokens=6" in result.stdout
    import yaml

    text = (tmp_path / "fit" / "fit_tree.yaml").read_text()
    fitted = yaml.safe_load(text)
    assert fitted["method"] == "eagle3" and "dart-eval tree=" not in text.splitlines()[0]
    assert set(fitted["tree"]) == {"top_k", "depth", "total_tokens"} and fitted["tree"]["total_tokens"] == 6
    assert len(fitted["all"]) == 2 and {r["top_k"] for r in fitted["all"]} == {2, 4}
