"""The DART vs EAGLE-3 table (docs/dart-vs-eagle3.md) from the training sweep (configs/experiment/dart_vs_eagle3.yaml) + eval.sh:

    python docs/results/dart_vs_eagle3/table.py runs/cmp3m

Training tokens/s: median of each run's metrics.jsonl; simulated held-out τ: its last train_eval;
served rows: <run>/served/results.json (dart-eval). ms per step = the phase's share of the method's
time × its seconds / its verification steps (tokens emitted / τ).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def train_row(run: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/tau" in r]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r),
            "tau": evals[-1]["eval/tau"], "alpha_1": evals[-1]["eval/alpha_1"], "step": evals[-1]["step"]}


def main(out: Path) -> None:
    summary = json.loads((out / "served" / "results.json").read_text())["summary"]
    train = {m: train_row(out / m) for m in ("dart", "eagle3")}
    benches = list(summary)
    print("| | DART | EAGLE-3 |\n|---|---|---|")
    print(f"| training tokens/s (median) | {train['dart']['tokens_per_s']:,.0f} | {train['eagle3']['tokens_per_s']:,.0f} |")
    print(f"| simulated held-out τ, α₁ (step {train['dart']['step']}) | {train['dart']['tau']:.2f}, "
          f"{train['dart']['alpha_1']:.2f} | {train['eagle3']['tau']:.2f}, {train['eagle3']['alpha_1']:.2f} |")
    ratios = []
    for bench in benches:
        rows = summary[bench]["T=0"]
        d, e = rows["dart"], rows["eagle3"]
        ratios.append(d["speedup_vs_fastest_plain"] / e["speedup_vs_fastest_plain"])
        print(f"| {bench}: τ | {d['tau']:.2f} | {e['tau']:.2f} |")
        print(f"| {bench}: tokens/s, × fastest plain ({d['fastest_plain']} {rows[d['fastest_plain']]['tokens_per_second']:.1f}) "
              f"| {d['tokens_per_second']:.1f}, {d['speedup_vs_fastest_plain']:.2f}× "
              f"| {e['tokens_per_second']:.1f}, {e['speedup_vs_fastest_plain']:.2f}× |")
    for phase in ("draft", "search", "verify"):
        cells = []
        for method in ("dart", "eagle3"):
            ms = []
            for bench in benches:
                row = summary[bench]["T=0"][method]
                steps = row["new_tokens"] / row["tau"]
                ms.append(row["time_split"].get(phase, 0.0) * row["seconds"] * 1000 / steps)
            cells.append(f"{statistics.mean(ms):.1f}")
        print(f"| {phase} ms per step (mean over benchmarks) | {cells[0]} | {cells[1]} |")
    print("\nDART's speedup / EAGLE-3's: " + ", ".join(f"{b} {r:.2f}×" for b, r in zip(benches, ratios, strict=True))
          + f"; mean {statistics.mean(ratios):.2f}×")
    pl = {b: summary[b]["T=0"]["prompt_lookup"]["speedup_vs_fastest_plain"]
          for b in benches if "prompt_lookup" in summary[b]["T=0"]}
    if pl:
        print("prompt lookup × fastest plain: " + ", ".join(f"{b} {v:.2f}×" for b, v in pl.items()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
