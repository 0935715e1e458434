"""Held-out τ against training tokens, from the `metrics.jsonl` of one or more `dart-train` runs.

    python scripts/plot_tau_curve.py runs/ref3 [runs/other ...] --out docs/results/tau_vs_tokens.png

Each evaluation row of a run (`eval/tau`, written every `train_eval.every` steps) is placed at the
tokens the run had trained on by then (the sum of the step rows' tokens up to that step; rows are
logged every `log_every` steps and stand for the steps since the previous logged row). Writes the
plot and a Markdown table next to it (`.md`), and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run_dir: Path) -> list[dict[str, float]]:
    """[(step, tokens, tau, tau_target, alpha_1, loss)] of a run's evaluations, in step order."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted({r["step"]: r for r in rows if "loss" in r and "tokens" in r}.values(), key=lambda r: r["step"])
    points, tokens, previous, index = [], 0.0, 0, 0
    for row in rows:
        if "eval/tau" not in row:
            continue
        step = int(row.get("step", 0))
        while index < len(steps) and steps[index]["step"] <= step:
            logged = steps[index]
            tokens += logged["tokens"] * (logged["step"] - previous)  # the logged step stands for those since the last
            previous = logged["step"]
            index += 1
        points.append({
            "step": step, "tokens": tokens, "tau": row["eval/tau"], "tau_target": row.get("eval/tau_target", float("nan")),
            "alpha_1": row.get("eval/alpha_1", float("nan")), "loss": row.get("eval/loss", float("nan")),
        })
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/results/tau_vs_tokens.png"))
    parser.add_argument("--title", default="Held-out simulated τ vs training tokens")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    lines = ["| run | step | tokens (M) | held-out τ | τ (target argmax) | α_1 | eval loss |", "|---|---|---|---|---|---|---|"]
    for run in args.runs:
        points = curve(run)
        if not points:
            raise SystemExit(f"{run}: no evaluation rows (eval/tau) in metrics.jsonl yet")
        ax.plot([p["tokens"] / 1e6 for p in points], [p["tau"] for p in points], marker="o", label=run.name)
        for p in points:
            lines.append(f"| {run.name} | {p['step']} | {p['tokens'] / 1e6:.2f} | {p['tau']:.3f} | "
                         f"{p['tau_target']:.3f} | {p['alpha_1']:.3f} | {p['loss']:.2f} |")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("held-out τ (simulated)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    table = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(table)
    print(table)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
