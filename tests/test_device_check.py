"""scripts/device_check.sh run --dry-run: the GPU device check's steps (dart-ngram, dart-train,
dart-eval with the paper's tree, the JSON report) at CPU size on a tiny random Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_device_check_dry_run_writes_the_report(smollm2_tokenizer, tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path / "model", smollm2_tokenizer)
    chats = [{"messages": [{"role": "user", "content": f"Count from {i} to {i + 4}."},
                           {"role": "assistant", "content": " ".join(str(k) for k in range(i, i + 5))}]}
             for i in range(12)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Count to five."}\n')
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"}}
    env.update(PY=sys.executable, OUT=str(tmp_path / "out"), OMP_NUM_THREADS="1")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "run", "--dry-run", "--model", str(tmp_path / "model"),
         "--data", str(tmp_path / "chats.jsonl"), "--prompts", str(tmp_path / "prompts.jsonl"),
         "--work", str(tmp_path / "work")],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert report["dry_run"] and report["hardware"] == "cpu" and report["train"]["steps"] == 2
    assert report["train"]["tokens_per_s"] > 0 and report["train"]["memory_estimate"].startswith("peak memory estimate")
    assert report["tau"] >= 1.0 and report["speedup"] > 0
    assert {"ar", "dart"} <= set(report["eval"]["methods"])
    assert "no vLLM venv" in report["vllm"]["skipped"]  # stage 4 says why it did not run
    # What comes back from a device call: a few flat files (its limits: 8 files, plain names).
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["device_check.json", "eval.log", "ngram.log", "results.md", "train.log"]
    # The eval ran with the paper's tree.
    assert "remain_total: 60" in (tmp_path / "out" / "eval.log").read_text()


def test_device_check_without_a_stage_prints_its_usage() -> None:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh")], capture_output=True, text=True)
    assert result.returncode == 2 and "device_check.sh run" in result.stdout
