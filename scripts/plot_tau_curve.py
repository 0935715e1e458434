"""Held-out τ against training tokens, from the `metrics.jsonl` of one or more `dart-train` runs.

    python scripts/plot_tau_curve.py runs/ref3 [runs/other ...] --out docs/results/tau_vs_tokens.png
    python scripts/plot_tau_curve.py runs/ref4:5.50 --prior docs/results/tau_vs_tokens.md --served 5.50:2.12

A run given as `PATH:M` continues a head trained on M million tokens before (`draft.init_from`): its
points are shifted by M. `PATH:M:S` draws only its evaluations from step S on (earlier ones were
made with other evaluation settings, e.g. another tree). `--prior TABLE.md` draws the rows of an
earlier table this script wrote (for runs whose metrics are gone) first and keeps them in the new
table, except the rows of runs given again (so the same command rewrites its table as a run goes on).

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


def parse_run(spec: str) -> tuple[Path, float, int]:
    """`PATH[:M[:S]]` -> (run directory, tokens trained before it, first step drawn)."""
    path, _, rest = spec.partition(":")
    before, _, first_step = rest.partition(":")
    return Path(path), float(before or 0) * 1e6, int(first_step or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories, each optionally PATH:M (M million tokens before)")
    parser.add_argument("--prior", type=Path, help="an earlier table of this script's to draw first")
    parser.add_argument("--served", action="append", default=[], metavar="M:TAU",
                        help="a served τ (dart-eval) of the head at M million tokens, drawn as its own series")
    parser.add_argument("--out", type=Path, default=Path("docs/results/tau_vs_tokens.png"))
    parser.add_argument("--title", default="Held-out simulated τ vs training tokens")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    lines = ["| run | step | tokens (M) | held-out τ | τ (target argmax) | α_1 | eval loss |", "|---|---|---|---|---|---|---|"]
    runs = [parse_run(spec) for spec in args.runs]
    plotted = {run.name for run, _, _ in runs}
    if args.prior:
        prior: dict[str, list[tuple[float, float]]] = {}
        for row in args.prior.read_text().splitlines()[2:]:
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            if len(cells) == 7 and cells[0] not in plotted:  # a run given again is redrawn from its metrics
                prior.setdefault(cells[0], []).append((float(cells[2]), float(cells[3])))
                lines.append(row.strip())
        for name, xy in prior.items():
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=f"{name} (earlier run)")
    for run, offset, first_step in runs:
        points = [p for p in curve(run) if p["step"] >= first_step]
        if not points:
            raise SystemExit(f"{run}: no evaluation rows (eval/tau) in metrics.jsonl yet")
        label = f"{run.name} (from {offset / 1e6:.2f} M)" if offset else run.name
        ax.plot([(p["tokens"] + offset) / 1e6 for p in points], [p["tau"] for p in points], marker="o", label=label)
        for p in points:
            lines.append(f"| {run.name} | {p['step']} | {(p['tokens'] + offset) / 1e6:.2f} | {p['tau']:.3f} | "
                         f"{p['tau_target']:.3f} | {p['alpha_1']:.3f} | {p['loss']:.2f} |")
    if args.served:
        served = sorted(tuple(float(v) for v in point.split(":")) for point in args.served)
        ax.plot([m for m, _ in served], [t for _, t in served], marker="s", linestyle="--",
                label="served τ (dart-eval MT-Bench)")
        lines += ["", "| served at (M tokens) | τ (dart-eval) |", "|---|---|"]
        lines += [f"| {m:.2f} | {t:.2f} |" for m, t in served]
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("τ (held-out, simulated; squares: served)" if args.served else "held-out τ (simulated)")
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
