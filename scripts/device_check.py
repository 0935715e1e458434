"""The GPU device check's Python part (run by scripts/device_check.sh, or alone where the project is
installed): the product's own commands, in order, on one machine, and one JSON of what they measured.

1. `dart-ngram`: a trie from the training conversations (the trie DART searches with);
2. `dart-train hardware=<gpu|cpu>`: a head trained for `--steps` optimiser steps (on a GPU: ZeRO-2,
   bf16, bounded anchors, BlockMask attention through compiled flex_attention), wall time, tokens/s,
   the memory estimate dart-train prints and the peak memory the run reached;
3. `dart-eval tree=gpu` (the paper's tree): τ, tokens/s and speedup of DART against plain decoding;
4. with `--vllm-venv` (a venv holding vLLM and our plugin): the same head beside vLLM plain, vLLM's
   prompt lookup and DART inside vLLM (`dart-eval methods=[ar,dart,vllm,vllm_ngram,vllm_dart]`).

Writes `<out>/device_check.json` (+ the commands' logs and dart-eval's results.md); the runs
themselves go to `--work` (checkpoints are not what comes back). `--dry-run`: CPU-sized budgets
(2 steps, 1 prompt, 8 tokens) through the same steps, for CI and a rehearsal.

    python scripts/device_check.py --model /ckpt/smollm2 --data train.jsonl --prompts mtbench.jsonl --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENTRY = {
    "ngram": "from dart_infer.cli.ngram import main; main()",
    "train": "from dart_train.cli import main; main()",
    "eval": "from dart_infer.cli.eval import main; main()",
}


def run_stage(name: str, overrides: list[str], out: Path, work: Path, log_name: str | None = None) -> tuple[str, float]:
    """One command of the product as a fresh process; its output is kept in `<out>/<log_name>.log`."""
    log_name = log_name or name
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", ENTRY[name], *overrides, f"hydra.run.dir={work / 'hydra' / log_name}"],
        capture_output=True, text=True, cwd=work,
    )
    seconds = time.perf_counter() - started
    (out / f"{log_name}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed ({result.returncode}); see {out / f'{log_name}.log'}:\n{result.stderr[-3000:]}")
    return result.stdout, seconds


def budgets(dry_run: bool, steps: int | None, limit: int | None, max_new_tokens: int | None) -> dict[str, int]:
    sized = {"steps": 2, "limit": 1, "max_new_tokens": 8, "max_length": 256, "max_tokens": 512, "anchors": 16,
             "conversations": 16} if dry_run else {
             # Sized for one 10-minute call: install + build ~2 min, compile + 400 steps ~3 min, 7 methods
             # x 20 prompts x 128 tokens ~2-3 min (SmolLM2 decodes at ~100-200 tokens/s, Python-bound).
             "steps": 400, "limit": 20, "max_new_tokens": 128, "max_length": 2048, "max_tokens": 16384,
             "anchors": 512, "conversations": 0}
    for key, value in (("steps", steps), ("limit", limit), ("max_new_tokens", max_new_tokens)):
        if value is not None:
            sized[key] = value
    return sized


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="embedded name, Hub id or checkpoint dir")
    parser.add_argument("--data", required=True, help="training conversations (.json/.jsonl)")
    parser.add_argument("--prompts", required=True, help="evaluation prompts (.json/.jsonl)")
    parser.add_argument("--out", required=True, help="where device_check.json and the logs go")
    parser.add_argument("--work", default=None, help="run directories (default: <out>/../device-check-work)")
    parser.add_argument("--dry-run", action="store_true", help="CPU-sized budgets, same steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None, help="evaluation prompts")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--vllm-venv", default=None, help="a venv with vLLM (CUDA wheel) and our plugin "
                        "(scripts/vllm_plugin): adds stage 4, vLLM plain / ngram / DART beside our DART")
    args = parser.parse_args(argv)

    import torch

    out = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out.parent / "device-check-work"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    size = budgets(args.dry_run, args.steps, args.limit, args.max_new_tokens)
    cuda = torch.cuda.is_available()
    hardware = "gpu" if cuda else "cpu"
    data, prompts = str(Path(args.data).resolve()), str(Path(args.prompts).resolve())
    model = ["model=custom", f"model.name_or_path={args.model}"] if args.model != "smollm2-135m-instruct" else []
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "hardware": hardware, "dry_run": args.dry_run,
        "torch": torch.__version__, "budgets": size,
    }

    # 1. The trie, from the training conversations.
    _, seconds = run_stage("ngram", [
        *model, "ngram.name=device-check", f"ngram.sources.0.source={data}", "ngram.sources.0.split=null",
        f"out_dir={work / 'ngram'}", "overwrite=true", "progress=false",
    ], out, work)
    report["ngram_seconds"] = seconds

    # 2. Training.
    train_dir = work / "train"
    limit = [f"data.limit={size['conversations']}"] if size["conversations"] else []
    stdout, seconds = run_stage("train", [
        *model, f"hardware={hardware}", "data=jsonl", f"data.source={data}", *limit,
        f"trainer.max_steps={size['steps']}", f"trainer.max_tokens={size['max_tokens']}",
        f"trainer.max_anchors={size['anchors']}", "trainer.save_every=null", f"preprocess.max_length={size['max_length']}",
        "optim.lr=1e-3", "optim.warmup_steps=20", "train_eval=off", "logging.wandb.enabled=false",
        "logging.progress=false", "logging.log_every=10", f"output_dir={train_dir}", f"output_root={work / 'artifacts'}",
        "resume=auto",  # a rerun on the same machine continues the run instead of refusing it
    ], out, work)
    summary = json.loads((train_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    estimate = re.search(r"# dart-train: (peak memory estimate.*)", stdout)
    report["train"] = {
        "steps": summary["steps"], "seconds": seconds, "train_loop_seconds": summary["seconds"],
        "final_loss": summary["final_loss"],
        "tokens_per_s": sum(r["tokens_per_s"] for r in rows[1:] or rows) / max(1, len(rows[1:] or rows)),
        "peak_memory_gib": summary["peak_memory_bytes"] / 1024**3 if summary.get("peak_memory_bytes") else None,
        "memory_estimate": estimate.group(1) if estimate else None,
        "timings": summary["timings"],
    }

    # 3. Evaluation with the paper's tree, eager: the GPU's loop (compile=auto compiles only on CPUs, so
    #    it would turn a --dry-run into minutes of compiling the CPU path).
    _, seconds = run_stage("eval", [
        *model, f"hardware={hardware}", "tree=gpu", "compile=false", f"draft_model={train_dir / 'head'}",
        f"ngram_model={work / 'ngram' / 'full.ngt'}", f"benchmarks=[{prompts}]", f"limit={size['limit']}",
        f"max_new_tokens={size['max_new_tokens']}", "temperature=[0.0]", f"out_dir={work / 'eval'}",
    ], out, work)
    results = json.loads((work / "eval" / "results.json").read_text())
    (out / "results.md").write_text((work / "eval" / "results.md").read_text())
    table = next(iter(next(iter(results["summary"].values())).values()))  # the one benchmark, T=0
    keys = ("tokens_per_second", "tau", "speedup_vs_ar", "speedup_vs_fastest_plain")
    report["eval"] = {"seconds": seconds, "methods": {label: {k: row.get(k) for k in keys} for label, row in table.items()}}
    dart = next((row for label, row in table.items() if row.get("method") == "dart"), None)
    if dart is not None:
        report["tau"], report["speedup"] = dart.get("tau"), dart.get("speedup_vs_fastest_plain")
    # 4. vLLM on the same prompts, methods interleaved (issue 31), where a venv with vLLM exists: the
    #    lent machine has no network, and vLLM's CUDA wheel with its torch (~2 GB) does not travel in
    #    64 MiB calls, so this stage runs only where one is already installed.
    venv = Path(args.vllm_venv).resolve() if args.vllm_venv else None
    if venv is None or not (venv / "bin" / "python").exists():
        report["vllm"] = {"skipped": f"no vLLM venv ({venv or 'pass --vllm-venv'})"}
    else:
        os.environ["VLLM_VENV"] = str(venv)
        _, seconds = run_stage("eval", [
            *model, f"hardware={hardware}", "tree=gpu", "compile=false", f"draft_model={train_dir / 'head'}",
            f"ngram_model={work / 'ngram' / 'full.ngt'}", f"benchmarks=[{prompts}]", f"limit={size['limit']}",
            f"max_new_tokens={size['max_new_tokens']}", "temperature=[0.0]", f"out_dir={work / 'eval-vllm'}",
            "methods=[ar,dart,vllm,vllm_ngram,vllm_dart]", "baseline_dtypes=[]", "model.dtype=bfloat16",
        ], out, work, log_name="eval-vllm")
        table = next(iter(next(iter(json.loads((work / "eval-vllm" / "results.json").read_text())["summary"]
                                    .values())).values()))
        report["vllm"] = {"seconds": seconds, "methods": {label: {k: row.get(k) for k in (*keys, "speedup_vs_vllm")}
                                                          for label, row in table.items()}}
    (out / "device_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
