"""One table for the training runs of a sweep (`dart-train -m experiment=...`): every run directory
under the given ones that has a metrics.jsonl, with what its command line changed and its numbers.

    python scripts/sweep_table.py runs/ab                    # recipe A/Bs (configs/experiment/recipe_ab.yaml)
    python scripts/sweep_table.py runs/lr runs/cmp3m         # DART vs EAGLE-3 (experiment/dart_vs_eagle3.yaml)

Columns: the run's overrides (from its .hydra/overrides.yaml), median training tokens/s, and at its
last evaluation held-out τ (the paper's search), the served tree's τ when logged, α₁, the held-out
loss; the last logged training loss and the tokens trained.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml

NAN = float("nan")


def run_row(run: Path) -> dict[str, object]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "eval/tau" not in r]
    evals = [r for r in rows if "eval/tau" in r]
    last = evals[-1] if evals else {}
    overrides_file = run / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
    return {
        "overrides": " ".join(o for o in overrides if not o.startswith("experiment=")) or "–",
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps) if steps else NAN,
        "step": last.get("step", "–"),
        "tau": last.get("eval/tau", NAN), "tau_served": last.get("eval/tau_served", NAN),
        "alpha_1": last.get("eval/alpha_1", NAN), "eval_loss": last.get("eval/loss", NAN),
        "train_loss": steps[-1]["loss"] if steps else NAN,
        # Rows are logged every log_every steps and describe that step: scale their mean to all steps.
        "tokens": steps[-1]["step"] * sum(r["tokens"] for r in steps) / len(steps) if steps else 0,
    }


def main(roots: list[str]) -> None:
    runs = sorted({path.parent for root in roots for path in Path(root).rglob("metrics.jsonl")})
    if not runs:
        raise SystemExit(f"no run with a metrics.jsonl under {' '.join(roots)}")
    print("| run | overrides | tokens/s | eval step | held-out τ (paper's search) | τ served tree | α₁ | eval loss "
          "| train loss | tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        r = run_row(run)
        print(f"| {run} | {r['overrides']} | {r['tokens_per_s']:,.0f} | {r['step']} | {r['tau']:.3f} | "
              f"{r['tau_served']:.3f} | {r['alpha_1']:.3f} | {r['eval_loss']:.3f} | {r['train_loss']:.3f} | "
              f"{r['tokens']:,.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["runs/ab"])
