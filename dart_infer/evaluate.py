"""τ and wall-clock speedup of DART against the baselines, on the same prompts in the same process.

Methods (names used in configs, JSON and tables):
- `ar`: plain autoregressive decoding through our target adapter — the speedup baseline;
- `hf_generate`: transformers' own greedy `generate` (sanity reference);
- `prompt_lookup`: transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`), the speculative
  decoder a transformers user already has;
- `dart`: DART with the n-gram trie; `dart_no_trie`: DART with the n-gram term switched off.

Methods are interleaved per prompt (the order rotates from prompt to prompt) after a warm-up, so slow
drifts of a noisy machine hit every method alike. τ = tokens emitted per verification step, bonus
included. Greedy outputs are compared token for token with `ar` (lossless in float32).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dart_infer.conversations import Conversation
from dart_infer.generate import DartModel
from dart_infer.tree import TreeSearchSettings

log = logging.getLogger(__name__)

METHODS = ("ar", "hf_generate", "prompt_lookup", "dart", "dart_no_trie")
SPECULATIVE = ("dart", "dart_no_trie")
PHASES = ("prefill", "draft", "search", "verify", "bookkeeping")


@dataclass
class Record:
    """One (prompt, turn, method) generation."""

    benchmark: str
    prompt_id: str
    turn: int
    method: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    steps: int | None = None  # verification steps (None where the method does not report them)
    step_tokens: int | None = None  # tokens emitted by those steps (the prefill's first token excluded)
    accept_lengths: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    identical_to_ar: bool | None = None
    output_ids: list[int] = field(default_factory=list)


@dataclass
class EvalSettings:
    methods: Sequence[str] = METHODS
    max_new_tokens: int = 256
    multi_turn: bool = False  # MT-Bench: also the second turn, with the model's own first answer
    prompt_lookup_num_tokens: int = 10
    warmup_tokens: int = 16
    threads: int | None = None

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
        if "ar" not in self.methods:
            raise ValueError("the 'ar' method is the speedup baseline and must be included")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Token ids of `messages` under the tokenizer's chat template, ready for the assistant's answer."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    else:  # base models without a template: plain concatenation of the turns
        ids = tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    if not ids:
        raise ValueError("empty prompt after tokenization")
    return torch.tensor(ids, dtype=torch.long)


def first_turn(conversation: Conversation) -> list[dict[str, str]]:
    """The messages of a conversation's first prompt: a leading system message, then the first user turn."""
    user = next((m for m in conversation.messages if m["role"] == "user"), None)
    if user is None:
        raise ValueError(f"conversation {conversation.id!r} has no user turn to prompt with")
    return [*(m for m in conversation.messages[:1] if m["role"] == "system"), user]


class Evaluator:
    """Runs the chosen methods over conversations and collects `Record`s."""

    def __init__(self, model: DartModel, settings: EvalSettings) -> None:
        self.model = model
        self.settings = settings
        if settings.threads:
            torch.set_num_threads(settings.threads)
        if "dart" in settings.methods and model.trie is None:
            raise ValueError("method 'dart' needs an n-gram trie (ngram_model); use 'dart_no_trie' without one")
        # Each runner: (prompt ids, max new tokens) -> Record.
        self._runners: dict[str, Callable[[torch.Tensor, int], Record]] = {
            "ar": self._run_ar,
            "hf_generate": self._run_hf,
            "prompt_lookup": self._run_prompt_lookup,
            "dart": lambda ids, n: self._run_dart(ids, n, "dart", None),
            "dart_no_trie": lambda ids, n: self._run_dart(ids, n, "dart_no_trie", {"ngram_weight": 0.0}),
        }

    # ---------------------------------------------------------------------------------- methods
    def _run_ar(self, ids: torch.Tensor, max_new: int) -> Record:
        out, stats = self.model.ar_generate(ids, max_new_token_num=max_new, profile=True, return_stats=True)
        return self._record("ar", ids, out, stats.wall_time, timings=stats.timings)

    def _run_dart(self, ids: torch.Tensor, max_new: int, name: str, tree: dict[str, Any] | None) -> Record:
        out, stats = self.model.dart_generate(
            ids, max_new_token_num=max_new, tree=tree, profile=True, return_stats=True
        )
        return self._record(
            name, ids, out, stats.wall_time, steps=stats.steps, step_tokens=sum(stats.emitted), timings=stats.timings,
            accept_lengths=list(stats.accept_lengths),
        )

    def _hf(self, ids: torch.Tensor, max_new: int, **kwargs: Any) -> tuple[torch.Tensor, float]:
        base = self.model.base_model
        device = base.get_input_embeddings().weight.device
        inputs = ids[None].to(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = base.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=list(self.model.eos_token_ids),
                pad_token_id=self.model.eos_token_ids[0],
                **kwargs,
            )
        return out.cpu(), time.perf_counter() - start

    def _run_hf(self, ids: torch.Tensor, max_new: int) -> Record:
        out, seconds = self._hf(ids, max_new)
        return self._record("hf_generate", ids, out, seconds)

    def _run_prompt_lookup(self, ids: torch.Tensor, max_new: int) -> Record:
        out, seconds = self._hf(ids, max_new, prompt_lookup_num_tokens=self.settings.prompt_lookup_num_tokens)
        return self._record("prompt_lookup", ids, out, seconds)

    @staticmethod
    def _record(method: str, ids: torch.Tensor, out: torch.Tensor, seconds: float, **extra: Any) -> Record:
        new = out[0, ids.numel():].tolist()
        return Record(
            benchmark="", prompt_id="", turn=0, method=method, prompt_tokens=ids.numel(),
            new_tokens=len(new), seconds=seconds, output_ids=new, **extra,
        )

    # --------------------------------------------------------------------------------- running
    def warm_up(self) -> None:
        """One short generation per method: first-call costs (allocations, kernels) stay out of the numbers."""
        ids = chat_prompt(self.model.tokenizer, [{"role": "user", "content": "Say hello."}])
        for method in self.settings.methods:
            self._runners[method](ids, self.settings.warmup_tokens)

    def run(self, benchmark: str, conversations: Sequence[Conversation], progress: bool = True) -> list[Record]:
        from tqdm.auto import tqdm

        records: list[Record] = []
        methods = list(self.settings.methods)
        bar = tqdm(conversations, desc=f"{benchmark}", disable=not progress, unit="prompt")
        for index, conversation in enumerate(bar):
            user_turns = [m for m in conversation.messages if m["role"] == "user"]
            history: list[dict[str, str]] = [m for m in conversation.messages[:1] if m["role"] == "system"]
            turns = user_turns if self.settings.multi_turn else user_turns[:1]
            for turn_index, user in enumerate(turns):
                history.append(user)
                ids = chat_prompt(self.model.tokenizer, history)
                order = methods[index % len(methods):] + methods[: index % len(methods)]
                results = {method: self._runners[method](ids, self.settings.max_new_tokens) for method in order}
                reference = results["ar"].output_ids
                for method in methods:
                    record = results[method]
                    record.benchmark, record.prompt_id, record.turn = benchmark, conversation.id, turn_index
                    record.identical_to_ar = record.output_ids == reference
                    records.append(record)
                # The next turn sees the model's own answer (greedy = what every lossless method produced).
                history.append({"role": "assistant", "content": self.model.tokenizer.decode(
                    reference, skip_special_tokens=True)})
            if progress:
                done = [r for r in records if r.method in SPECULATIVE]
                if done:
                    bar.set_postfix(tau=f"{sum(r.step_tokens or 0 for r in done) / max(1, sum(r.steps or 0 for r in done)):.2f}")
        return records


# ------------------------------------------------------------------------------------ summaries


def summarize(records: Sequence[Record], draft_length: int) -> dict[str, dict[str, dict[str, Any]]]:
    """Per benchmark and method: τ, acceptance per position, tokens/s, speedups, time split, identity."""
    grouped: dict[str, dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        grouped[record.benchmark][record.method].append(record)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for benchmark, by_method in grouped.items():
        rows: dict[str, dict[str, Any]] = {}
        for method, items in by_method.items():
            tokens = sum(r.new_tokens for r in items)
            seconds = sum(r.seconds for r in items)
            steps = sum(r.steps or 0 for r in items)
            step_tokens = sum(r.step_tokens or 0 for r in items)
            accepts = [a for r in items for a in r.accept_lengths]
            timings: dict[str, float] = defaultdict(float)
            for r in items:
                for phase, value in r.timings.items():
                    timings[phase] += value
            rows[method] = {
                "prompts": len(items),
                "new_tokens": tokens,
                "seconds": seconds,
                "tokens_per_second": tokens / seconds if seconds else 0.0,
                "tau": step_tokens / steps if steps else None,
                # Share of verification steps that accepted at least j draft tokens (j = 1..d).
                "acceptance_by_position": [
                    sum(a >= j for a in accepts) / len(accepts) for j in range(1, draft_length + 1)
                ] if accepts else None,
                "accept_length_histogram": [accepts.count(n) for n in range(draft_length + 1)] if accepts else None,
                "time_split": {phase: timings[phase] / seconds for phase in PHASES if phase in timings} if seconds else {},
                "identical_to_ar": sum(bool(r.identical_to_ar) for r in items) / len(items),
            }
        for row in rows.values():
            for base in ("ar", "hf_generate"):
                if base in rows and rows[base]["tokens_per_second"]:
                    row[f"speedup_vs_{base}"] = row["tokens_per_second"] / rows[base]["tokens_per_second"]
        summary[benchmark] = rows
    return summary


def markdown_table(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| benchmark | method | prompts | τ | tokens/s | speedup vs AR | speedup vs HF generate | identical to AR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for benchmark, rows in summary.items():
        for method, row in rows.items():
            tau = f"{row['tau']:.2f}" if row["tau"] else "–"
            vs_hf = f"{row['speedup_vs_hf_generate']:.2f}×" if "speedup_vs_hf_generate" in row else "–"
            lines.append(
                f"| {benchmark} | {method} | {row['prompts']} | {tau} | {row['tokens_per_second']:.1f} | "
                f"{row.get('speedup_vs_ar', 0):.2f}× | {vs_hf} | {row['identical_to_ar'] * 100:.0f}% |"
            )
    return "\n".join(lines)


def save_results(
    out_dir: str | Path, records: Sequence[Record], summary: dict[str, Any], meta: dict[str, Any]
) -> dict[str, Path]:
    """Write results.json (everything), results.md (the table) and the plots; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(
        {"meta": meta, "summary": summary, "records": [asdict(r) for r in records]}, indent=1))
    paths["markdown"].write_text(markdown_table(summary) + "\n")
    paths.update(plot(summary, out))
    return paths


def plot(summary: dict[str, dict[str, dict[str, Any]]], out: Path) -> dict[str, Path]:
    """τ and speedup per benchmark and method, acceptance-length histogram, time breakdown (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}
    benchmarks = list(summary)
    methods = [m for m in METHODS if any(m in rows for rows in summary.values())]
    width = 0.8 / max(1, len(methods))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for i, method in enumerate(methods):
        xs = [b + i * width for b in range(len(benchmarks))]
        axes[0].bar(xs, [summary[b].get(method, {}).get("speedup_vs_ar", 0) for b in benchmarks], width, label=method)
        axes[1].bar(xs, [summary[b].get(method, {}).get("tau") or 0 for b in benchmarks], width, label=method)
    for ax, title in zip(axes, ("speedup vs our AR", "τ (tokens per verification)"), strict=True):
        ax.set_xticks([b + width * (len(methods) - 1) / 2 for b in range(len(benchmarks))], benchmarks)
        ax.set_title(title)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths["speedup_plot"] = out / "speedup_tau.png"
    fig.savefig(paths["speedup_plot"], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for benchmark in benchmarks:
        for method in SPECULATIVE:
            hist = summary[benchmark].get(method, {}).get("accept_length_histogram")
            if hist:
                total = sum(hist)
                ax.plot(range(len(hist)), [h / total for h in hist], marker="o", label=f"{benchmark}/{method}")
    ax.set_xlabel("draft tokens accepted per step")
    ax.set_ylabel("share of steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["acceptance_plot"] = out / "acceptance_hist.png"
    fig.savefig(paths["acceptance_plot"], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, bottoms = [], []
    for benchmark in benchmarks:
        for method in ("ar", *SPECULATIVE):
            if method in summary[benchmark]:
                labels.append(f"{benchmark}\n{method}")
                bottoms.append(summary[benchmark][method]["time_split"])
    left = [0.0] * len(labels)
    for phase in PHASES:
        values = [split.get(phase, 0.0) for split in bottoms]
        ax.barh(labels, values, left=left, label=phase)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlabel("share of wall time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["time_plot"] = out / "time_breakdown.png"
    fig.savefig(paths["time_plot"], dpi=100)
    plt.close(fig)
    return paths


# ------------------------------------------------------------------------------- tree-size fit


def fit_tree(
    model: DartModel,
    prompts: Sequence[torch.Tensor],
    grid: Sequence[dict[str, int]],
    max_new_tokens: int,
) -> list[dict[str, Any]]:
    """Measure DART's speedup over AR on this machine for each tree setting; best first.

    A GPU verifies 60 nodes for about the cost of one; a CPU does not, so the tree that maximises
    speedup depends on the hardware and has to be measured. Each setting is timed against AR runs
    interleaved with its own, prompt by prompt, so drift of the machine's speed cancels in the ratio.
    """
    for setting in grid:
        TreeSearchSettings().with_overrides(setting)  # validates names and values before timing
    results = []
    # Warm-up: first calls pay one-time kernel and allocator set-up that would flatter the later ones.
    model.ar_generate(prompts[0], max_new_token_num=8)
    model.dart_generate(prompts[0], max_new_token_num=8)
    for setting in grid:
        stats: dict[str, list[Any]] = {"ar": [], "dart": []}
        for i, ids in enumerate(prompts):
            for kind in ("ar", "dart") if i % 2 == 0 else ("dart", "ar"):  # alternate which goes first
                generate = model.ar_generate if kind == "ar" else partial(model.dart_generate, tree=setting)
                stats[kind].append(generate(ids, max_new_token_num=max_new_tokens, return_stats=True)[1])
        ar, dart = stats["ar"], stats["dart"]
        rate = sum(s.new_tokens for s in dart) / sum(s.wall_time for s in dart)
        speedup = rate / (sum(s.new_tokens for s in ar) / sum(s.wall_time for s in ar))
        tau = sum(sum(s.emitted) for s in dart) / sum(s.steps for s in dart)
        results.append({**setting, "tau": tau, "tokens_per_second": rate, "speedup_vs_ar": speedup})
        log.info("tree %s: τ %.2f, %.1f tok/s, %.2f× AR", setting, tau, rate, speedup)
    return sorted(results, key=lambda r: r["speedup_vs_ar"], reverse=True)
