"""dart-eval's results: per-method summaries, the markdown table, results.json/.md and the plots.

The order a run publishes them in protects what it measured: the table is printed first (from the
records in memory), then results.json and results.md are written atomically, then the plots. A file
that cannot be written, or a plot that fails, costs one warning line naming the file and the reason,
never the table or the other files; the records are already in `<out_dir>/records.jsonl`
(`dart_infer.evaluation.records`), so a later run can write the results again without measuring.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dart_infer.common.files import atomic_path, atomic_write_bytes
from dart_infer.evaluation.evaluate import PHASES, PLAIN, SPECULATIVE
from dart_infer.evaluation.records import Record

log = logging.getLogger(__name__)

Summary = dict[str, dict[str, dict[str, dict[str, Any]]]]  # benchmark -> sampling -> label -> row
RESULT_FILES = {"json": "results.json", "markdown": "results.md"}


def _arithmetic(dtype: str) -> str:
    """"float32 (bf16 weights)" -> "float32": the dtype a row computes in."""
    return dtype.split(" (", 1)[0]


def summarize(records: Sequence[Record], draft_length: int) -> Summary:
    """Per benchmark, sampling setting and method (label): τ, acceptance per position, tokens/s,
    speedups (against the fastest plain decoding in any dtype and against `ar`/`hf_generate` in the
    same dtype), time split, and agreement (with same-dtype `ar`; at T=0 with the float32 target)."""
    grouped: dict[tuple[str, str], dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        grouped[record.benchmark, record.sampling][record.label or record.method].append(record)
    summary: Summary = defaultdict(dict)
    for (benchmark, sampling), by_label in grouped.items():
        rows = {label: _row(items, draft_length) for label, items in by_label.items()}
        plain = [label for label, row in rows.items() if row["method"] in PLAIN and row["tokens_per_second"]]
        fastest = max(plain, key=lambda label: rows[label]["tokens_per_second"]) if plain else None
        for row in rows.values():
            if fastest is not None:
                row["fastest_plain"] = fastest
                row["speedup_vs_fastest_plain"] = row["tokens_per_second"] / rows[fastest]["tokens_per_second"]
            for base in PLAIN:
                # vLLM loads the checkpoint's weights: our "float32 (bf16 weights)" rows meet it in float32.
                key = _arithmetic if base == "vllm" else str
                same = next((r for r in rows.values() if r["method"] == base and key(r["dtype"]) == key(row["dtype"])),
                            None)
                if same is not None and same["tokens_per_second"]:
                    row[f"speedup_vs_{base}"] = row["tokens_per_second"] / same["tokens_per_second"]
        summary[benchmark][sampling] = rows
    return dict(summary)


def _row(items: Sequence[Record], draft_length: int) -> dict[str, Any]:
    """One method's row of the summary (before the speedups, which need the other rows)."""
    tokens = sum(r.new_tokens for r in items)
    seconds = sum(r.seconds for r in items)
    steps = sum(r.steps or 0 for r in items)
    step_tokens = sum(r.step_tokens or 0 for r in items)
    accepts = [a for r in items for a in r.accept_lengths]
    timings: dict[str, float] = defaultdict(float)
    for r in items:
        for phase, value in r.timings.items():
            timings[phase] += value
    agreement = [r for r in items if r.identical_to_fp32 is not None]
    return {
        "method": items[0].method,
        "dtype": items[0].dtype,
        "prompts": len(items),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "tau": step_tokens / steps if steps else None,
        # Share of verification steps that accepted at least j draft tokens (j = 1..d).
        "acceptance_by_position": [
            sum(a >= j for a in accepts) / len(accepts) for j in range(1, draft_length + 1)
        ] if accepts else None,
        # Copy spans can reach past the draft's d levels: the histogram runs to the longest.
        "accept_length_histogram": [accepts.count(n) for n in range(max([draft_length, *accepts]) + 1)]
        if accepts else None,
        "time_split": {phase: timings[phase] / seconds for phase in PHASES if phase in timings} if seconds else {},
        "identical_to_ar": sum(bool(r.identical_to_ar) for r in items) / len(items),
        "identical_to_fp32": (
            sum(bool(r.identical_to_fp32) for r in agreement) / len(agreement) if agreement else None
        ),
        "tokens_to_first_difference": (
            sum(r.tokens_to_first_difference or 0 for r in agreement) / len(agreement) if agreement else None
        ),
    }


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}×" if row.get(key) is not None else "–"


def _share(value: float | None) -> str:
    return f"{value * 100:.0f}%" if value is not None else "–"


def markdown_table(summary: Summary) -> str:
    """One row per benchmark, setting and method; the fastest plain decoding of each group below."""
    lines = [
        "| benchmark | setting | method | dtype | prompts | τ | tokens/s | × fastest plain | × AR (same dtype) "
        "| × HF generate (same dtype) | × vLLM (same dtype) | identical to AR (same dtype) "
        "| identical to fp32 greedy | tokens to 1st difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for benchmark, settings in summary.items():
        for sampling, rows in settings.items():
            for label, row in rows.items():
                tau = f"{row['tau']:.2f}" if row["tau"] else "–"
                first_diff = row.get("tokens_to_first_difference")
                lines.append(
                    f"| {benchmark} | {sampling} | {label} | {row['dtype']} | {row['prompts']} | {tau} | "
                    f"{row['tokens_per_second']:.1f} | {_ratio(row, 'speedup_vs_fastest_plain')} | "
                    f"{_ratio(row, 'speedup_vs_ar')} | {_ratio(row, 'speedup_vs_hf_generate')} | {_ratio(row, 'speedup_vs_vllm')} | "
                    f"{_share(row['identical_to_ar'])} | {_share(row.get('identical_to_fp32'))} | "
                    f"{f'{first_diff:.1f}' if first_diff is not None else '–'} |"
                )
            fastest = next((row.get("fastest_plain") for row in rows.values()), None)
            if fastest:
                notes.append(f"{benchmark} {sampling}: {fastest} ({rows[fastest]['tokens_per_second']:.1f} tokens/s)")
    if notes:
        lines += ["", "Fastest plain decoding (AR, HF generate or vLLM, any dtype) per benchmark and setting: "
                  + "; ".join(notes) + "."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ files


@dataclass
class Saved:
    """What `save_results` wrote (`paths`, by kind) and what it could not (`failed`: file -> reason)."""

    paths: dict[str, Path] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def results_written(self) -> bool:
        return all(kind in self.paths for kind in RESULT_FILES)

    @property
    def results_failed(self) -> dict[str, str]:
        """The results files (not plots) that could not be written: file -> reason."""
        return {p: r for p, r in self.failed.items() if Path(p).name in RESULT_FILES.values()}


class ResultsNotWritten(OSError):
    """results.json or results.md could not be written (the table was printed, the records are kept)."""


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def save_results(out_dir: str | Path, records: Sequence[Record], summary: Summary, meta: dict[str, Any]) -> Saved:
    """results.json (everything) and results.md (the table), each atomic, then the plots.

    Each file is tried on its own: a failure logs one warning line (file and reason) and lands in
    `Saved.failed`, so a read-only directory or a broken plot never takes the other files with it."""
    out = Path(out_dir)
    saved = Saved()
    texts = {
        "json": lambda: json.dumps({"meta": meta, "summary": summary, "records": [asdict(r) for r in records]},
                                   indent=1),
        "markdown": lambda: markdown_table(summary) + "\n",
    }
    for kind, name in RESULT_FILES.items():
        path = out / name
        try:
            atomic_write_bytes(path, texts[kind]().encode())
            saved.paths[kind] = path
        except Exception as err:  # reported; the other files are still tried
            _failed(saved, path, err)
    write_plots(summary, out, saved)
    return saved


def _failed(saved: Saved, path: Path, err: BaseException) -> None:
    saved.failed[str(path)] = _reason(err)
    log.warning("could not write %s: %s", path, _reason(err))


# ------------------------------------------------------------------------------------------ plots


def _layout(summary: Summary) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(benchmark, setting) groups, their axis names, and every method label, in order."""
    groups = [(b, s) for b, settings in summary.items() for s in settings]
    names = [f"{b}\n{s}" if len(groups) > len(summary) else b for b, s in groups]
    labels = list(dict.fromkeys(label for b, s in groups for label in summary[b][s]))
    return groups, names, labels


def _speedup_figure(fig: Any, summary: Summary) -> None:
    groups, names, labels = _layout(summary)
    width = 0.8 / max(1, len(labels))
    axes = fig.subplots(1, 2)
    for i, label in enumerate(labels):
        xs = [g + i * width for g in range(len(groups))]
        rows = [summary[b][s].get(label, {}) for b, s in groups]
        axes[0].bar(xs, [r.get("speedup_vs_fastest_plain") or 0 for r in rows], width, label=label)
        axes[1].bar(xs, [r.get("tau") or 0 for r in rows], width, label=label)
    for ax, title in zip(axes, ("speedup vs the fastest plain decoding", "τ (tokens per verification)"), strict=True):
        ax.set_xticks([g + width * (len(labels) - 1) / 2 for g in range(len(groups))], names)
        ax.set_title(title)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    # Below both panels, so the legend never hides a bar.
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(labels), 7), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))


def _acceptance_figure(fig: Any, summary: Summary) -> None:
    groups, names, _ = _layout(summary)
    ax = fig.subplots()
    for (benchmark, sampling), name in zip(groups, names, strict=True):
        for label, row in summary[benchmark][sampling].items():
            hist = row.get("accept_length_histogram") if row["method"] in SPECULATIVE else None
            if hist:
                total = sum(hist)
                ax.plot(range(len(hist)), [h / total for h in hist], marker="o",
                        label=f"{name.replace(chr(10), ' ')}/{label}")
    ax.set_xlabel("draft tokens accepted per step")
    ax.set_ylabel("share of steps")
    if ax.get_legend_handles_labels()[0]:  # no speculative method: no curve to name
        ax.legend(fontsize=8)
    fig.tight_layout()


def _time_figure(fig: Any, summary: Summary) -> None:
    groups, names, _ = _layout(summary)
    ax = fig.subplots()
    bars, splits = [], []
    for (benchmark, sampling), name in zip(groups, names, strict=True):
        for label, row in summary[benchmark][sampling].items():
            if row["method"] in ("ar", *SPECULATIVE):
                bars.append(f"{name.replace(chr(10), ' ')}\n{label}")
                splits.append(row["time_split"])
    left = [0.0] * len(bars)
    for phase in PHASES:
        values = [split.get(phase, 0.0) for split in splits]
        ax.barh(bars, values, left=left, label=phase)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlabel("share of wall time")
    ax.legend(fontsize=8)
    fig.tight_layout()


# (kind, file, figure size, drawer): speedup and τ per benchmark/setting and method, the
# acceptance-length histogram, the time breakdown.
PLOTS: tuple[tuple[str, str, tuple[float, float], Callable[[Any, Summary], None]], ...] = (
    ("speedup_plot", "speedup_tau.png", (12, 4), _speedup_figure),
    ("acceptance_plot", "acceptance_hist.png", (6, 4), _acceptance_figure),
    ("time_plot", "time_breakdown.png", (7, 4), _time_figure),
)


def write_plots(summary: Summary, out_dir: str | Path, saved: Saved | None = None) -> Saved:
    """The PNG plots, each atomic and on its own: a failed one is a warning, the others are still drawn."""
    saved = saved if saved is not None else Saved()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        for _, name, _, _ in PLOTS:
            _failed(saved, Path(out_dir) / name, err)
        return saved
    for kind, name, size, draw in PLOTS:
        path = Path(out_dir) / name
        fig = plt.figure(figsize=size)
        try:
            draw(fig, summary)
            with atomic_path(path) as tmp:
                fig.savefig(tmp, dpi=100, format="png")  # the temporary name has no .png suffix
            saved.paths[kind] = path
        except Exception as err:  # a plot only views results already saved: never fatal
            _failed(saved, path, err)
        finally:
            plt.close(fig)
    return saved
