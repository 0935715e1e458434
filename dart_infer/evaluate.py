"""τ and wall-clock speedup of DART against the baselines, on the same prompts in the same process.

Methods (names used in configs, JSON and tables):
- `ar`: plain autoregressive decoding through our target adapter;
- `hf_generate`: transformers' own `generate` (greedy or sampling);
- `prompt_lookup`: transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`), the speculative
  decoder a transformers user already has;
- `dart`: DART with the n-gram trie; `dart_no_trie`: DART with the n-gram term switched off;
- `eagle3`: an EAGLE-3 head (`dart_infer.eagle3.Eagle3Model` on the same target) with EAGLE-2's dynamic
  tree, verified by the same loop as DART.

Every method runs in the serving dtype (the `DartModel`'s); the plain ones (`ar`, `hf_generate`) also
run in each dtype of `plain_models` (e.g. float32 and bfloat16), labelled `ar@fp32`, and each row's
speedup is reported against the fastest plain decoding in any dtype — what a user would otherwise run —
next to the same-dtype ratios. Each prompt runs at every sampling setting (`Sampling`: T=0 greedy,
T=1, ...), every method with the same seed, so sampled methods see the same settings and random
streams (`ar` and `hf_generate` then draw the same tokens in float32).

Methods are interleaved per prompt (the order rotates from prompt to prompt) after a warm-up, so slow
drifts of a noisy machine hit every method alike. τ = tokens emitted per verification step, bonus
included. Outputs are compared token for token with `ar` in the same dtype (lossless in float32,
greedy), and at T=0 with the float32 target's greedy output (`ar` in float32) where that ran:
share of prompts identical and tokens before the first difference.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dart_infer.conversations import Conversation
from dart_infer.generate import DartModel
from dart_infer.sampling import GREEDY_TEMPERATURE, Sampler
from dart_infer.stats import wall_clock

log = logging.getLogger(__name__)

METHODS = ("ar", "hf_generate", "prompt_lookup", "dart", "dart_no_trie")
EXTRA_METHODS = ("eagle3",)  # need a model of their own (`Evaluator(eagle3=...)`), so not in the default set
PLAIN = ("ar", "hf_generate")  # plain decoding: the speedup baselines, timed in every dtype
SPECULATIVE = ("dart", "dart_no_trie", "eagle3")
PHASES = ("prefill", "draft", "search", "verify", "bookkeeping")
_SHORT_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    """"float32", "bfloat16", ... (the name configs use)."""
    return str(dtype).removeprefix("torch.")


def run_label(method: str, dtype: torch.dtype, serving: torch.dtype) -> str:
    """A method's name in the serving dtype, `method@fp32`-style in another one."""
    return method if dtype == serving else f"{method}@{_SHORT_DTYPE.get(dtype, dtype_name(dtype))}"


@dataclass(frozen=True)
class Sampling:
    """One decoding setting: temperature (0 = greedy), top_p and top_k (0 = off), as `dart_generate`."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0

    def __post_init__(self) -> None:
        Sampler(self.temperature, self.top_p, self.top_k)  # the same checks as generation

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def label(self) -> str:
        if self.greedy:
            return "T=0"
        parts = [f"T={self.temperature:g}"]
        if 0.0 < self.top_p < 1.0:
            parts.append(f"top_p={self.top_p:g}")
        if self.top_k:
            parts.append(f"top_k={self.top_k}")
        return " ".join(parts)

    def hf_kwargs(self) -> dict[str, Any]:
        """The same setting for transformers' `generate` (which reads top_p 1.0 and top_k 0 as off and
        would otherwise fill unset knobs from the model's generation config)."""
        if self.greedy:
            return {"do_sample": False}
        return {
            "do_sample": True, "temperature": self.temperature, "top_k": self.top_k,
            "top_p": self.top_p if 0.0 < self.top_p < 1.0 else 1.0, "min_p": None, "typical_p": 1.0,
            "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "repetition_penalty": 1.0,
        }


@dataclass
class Record:
    """One (prompt, turn, sampling setting, method, dtype) generation."""

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
    identical_to_ar: bool | None = None  # same output as `ar` in the same dtype, setting and seed
    output_ids: list[int] = field(default_factory=list)
    dtype: str = "float32"
    label: str = ""  # the method's name in tables: `method`, or `method@fp32` outside the serving dtype
    sampling: str = "T=0"
    seed: int | None = None
    # T=0 against the float32 target's greedy output (`ar` in float32), where that ran:
    identical_to_fp32: bool | None = None
    tokens_to_first_difference: int | None = None  # common prefix; the whole output when identical


@dataclass
class EvalSettings:
    methods: Sequence[str] = METHODS
    max_new_tokens: int = 256
    multi_turn: bool = False  # MT-Bench: also the second turn, with the model's own first answer
    prompt_lookup_num_tokens: int = 10
    warmup_tokens: int = 16
    threads: int | None = None
    samplings: Sequence[Sampling] = (Sampling(),)
    seed: int = 0  # prompt i (counting turns and settings) runs every method with seed + i

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS + EXTRA_METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS + EXTRA_METHODS)}")
        if "ar" not in self.methods:
            raise ValueError("the 'ar' method is the speedup baseline and must be included")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.samplings:
            raise ValueError("give at least one sampling setting")
        labels = [s.label for s in self.samplings]
        if len(set(labels)) != len(labels):
            raise ValueError(f"sampling settings repeat: {labels}")


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Token ids of `messages` under the tokenizer's chat template, ready for the assistant's answer.

    A tokenizer without a template is an error, not a guess: heads are trained on conversations
    rendered with the template (`dart_train.template`), so prompts must be rendered the same way."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template to render the "
            "conversation with: set model.chat_template=gemma-turns|plain|<file.jinja> (a built-in name, a "
            ".jinja file or a Jinja string; the one the head was trained with), or pass chat_template= to "
            "DartModel.from_pretrained / dart_infer.loading.load_tokenizer"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    if not ids:
        raise ValueError("empty prompt after tokenization")
    return torch.tensor(ids, dtype=torch.long)


def first_turn(conversation: Conversation) -> list[dict[str, str]]:
    """The messages of a conversation's first prompt: a leading system message, then the first user turn."""
    user = next((m for m in conversation.messages if m["role"] == "user"), None)
    if user is None:
        raise ValueError(f"conversation {conversation.id!r} has no user turn to prompt with")
    return [*(m for m in conversation.messages[:1] if m["role"] == "system"), user]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (tokens before the first difference)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class _Run:
    """One method in one dtype: what the evaluator times for every prompt."""

    label: str
    method: str
    model: DartModel

    @property
    def dtype(self) -> torch.dtype:
        return self.model.target.dtype


class Evaluator:
    """Runs the chosen methods over conversations and collects `Record`s.

    `model` runs every method in its (serving) dtype; each of `plain_models` (the same target in other
    dtypes, e.g. `model.with_dtype("float32")` or a float32 load) runs the plain methods too.
    `eagle3` (an `Eagle3Model` on the same target, in the serving dtype) runs the `eagle3` method.
    """

    def __init__(
        self, model: DartModel, settings: EvalSettings, plain_models: Sequence[DartModel] = (), eagle3: Any = None
    ) -> None:
        self.model = model
        self.settings = settings
        if settings.threads:
            torch.set_num_threads(settings.threads)
        if "dart" in settings.methods and model.trie is None:
            raise ValueError("method 'dart' needs an n-gram trie (ngram_model); use 'dart_no_trie' without one")
        serving = model.target.dtype
        dtypes = [serving, *(m.target.dtype for m in plain_models)]
        if len(set(dtypes)) != len(dtypes):
            raise ValueError(f"one model per dtype: the serving model is {serving}, plain models {dtypes[1:]}")
        if "eagle3" in settings.methods and (eagle3 is None or eagle3.target.dtype != serving):
            raise ValueError(f"method 'eagle3' needs an Eagle3Model in the serving dtype {serving} (eagle3_model)")
        self.runs = [_Run(m, m, eagle3 if m == "eagle3" else model) for m in settings.methods]
        for other in plain_models:
            self.runs += [
                _Run(run_label(m, other.target.dtype, serving), m, other) for m in settings.methods if m in PLAIN
            ]
        self._fp32_ar = next((r.label for r in self.runs if r.method == "ar" and r.dtype == torch.float32), None)
        if serving != torch.float32 and self._fp32_ar is None:
            log.warning("no float32 'ar' run: agreement with the float32 target's output is not reported")
        # Each runner: (run, prompt ids, max new tokens, sampling, seed) -> Record.
        self._runners: dict[str, Callable[[_Run, torch.Tensor, int, Sampling, int], Record]] = {
            "ar": self._run_ar,
            "hf_generate": self._run_hf,
            "prompt_lookup": partial(self._run_hf, prompt_lookup=True),
            "dart": partial(self._run_dart, tree=None),
            "dart_no_trie": partial(self._run_dart, tree={"ngram_weight": 0.0}),
            "eagle3": partial(self._run_dart, tree=None, generate="eagle3_generate"),
        }

    # ---------------------------------------------------------------------------------- methods
    @staticmethod
    def _generator(model: DartModel, seed: int) -> torch.Generator:
        return torch.Generator(device=model.target.device).manual_seed(seed)

    def _run_ar(self, run: _Run, ids: torch.Tensor, max_new: int, sampling: Sampling, seed: int) -> Record:
        out, stats = run.model.ar_generate(
            ids, sampling.temperature, sampling.top_p, sampling.top_k, max_new_token_num=max_new,
            generator=self._generator(run.model, seed), profile=True, return_stats=True,
        )
        return self._record(run, ids, out, stats.wall_time, timings=stats.timings)

    def _run_dart(
        self, run: _Run, ids: torch.Tensor, max_new: int, sampling: Sampling, seed: int, *,
        tree: dict[str, Any] | None, generate: str = "dart_generate",
    ) -> Record:
        out, stats = getattr(run.model, generate)(
            ids, sampling.temperature, sampling.top_p, sampling.top_k, max_new_token_num=max_new,
            generator=self._generator(run.model, seed), tree=tree, profile=True, return_stats=True,
        )
        return self._record(
            run, ids, out, stats.wall_time, steps=stats.steps, step_tokens=sum(stats.emitted), timings=stats.timings,
            accept_lengths=list(stats.accept_lengths),
        )

    def _run_hf(
        self, run: _Run, ids: torch.Tensor, max_new: int, sampling: Sampling, seed: int, *, prompt_lookup: bool = False
    ) -> Record:
        base = run.model.base_model
        inputs = ids[None].to(run.model.target.device)
        extra = {"prompt_lookup_num_tokens": self.settings.prompt_lookup_num_tokens} if prompt_lookup else {}
        torch.manual_seed(seed)  # transformers samples from the global generator
        with torch.no_grad(), wall_clock(inputs.device) as elapsed:  # the rule AR and DART are timed by
            out = base.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_new,
                eos_token_id=list(run.model.eos_token_ids),
                pad_token_id=run.model.eos_token_ids[0],
                **sampling.hf_kwargs(),
                **extra,
            )
        return self._record(run, ids, out.cpu(), elapsed[0])

    @staticmethod
    def _record(run: _Run, ids: torch.Tensor, out: torch.Tensor, seconds: float, **extra: Any) -> Record:
        new = out[0, ids.numel():].tolist()
        return Record(
            benchmark="", prompt_id="", turn=0, method=run.method, prompt_tokens=ids.numel(),
            new_tokens=len(new), seconds=seconds, output_ids=new, dtype=dtype_name(run.dtype), label=run.label,
            **extra,
        )

    # --------------------------------------------------------------------------------- running
    def warm_up(self) -> None:
        """One short generation per run (and setting): first-call costs stay out of the numbers."""
        ids = chat_prompt(self.model.tokenizer, [{"role": "user", "content": "Say hello."}])
        for run in self.runs:
            for sampling in self.settings.samplings:
                self._runners[run.method](run, ids, self.settings.warmup_tokens, sampling, self.settings.seed)

    def run(self, benchmark: str, conversations: Sequence[Conversation], progress: bool = True) -> list[Record]:
        from tqdm.auto import tqdm

        records: list[Record] = []
        runs = list(self.runs)
        serving_ar = next(r.label for r in runs if r.method == "ar" and r.model is self.model)
        counter = 0
        bar = tqdm(conversations, desc=f"{benchmark}", disable=not progress, unit="prompt")
        for conversation in bar:
            user_turns = [m for m in conversation.messages if m["role"] == "user"]
            turns = user_turns if self.settings.multi_turn else user_turns[:1]
            for sampling in self.settings.samplings:
                history: list[dict[str, str]] = [m for m in conversation.messages[:1] if m["role"] == "system"]
                for turn_index, user in enumerate(turns):
                    history.append(user)
                    ids = chat_prompt(self.model.tokenizer, history)
                    seed = self.settings.seed + counter
                    shift = counter % len(runs)
                    counter += 1
                    results = {
                        run.label: self._runners[run.method](run, ids, self.settings.max_new_tokens, sampling, seed)
                        for run in runs[shift:] + runs[:shift]
                    }
                    fp32 = results[self._fp32_ar].output_ids if self._fp32_ar and sampling.greedy else None
                    for run in runs:
                        record = results[run.label]
                        record.benchmark, record.prompt_id, record.turn = benchmark, conversation.id, turn_index
                        record.sampling, record.seed = sampling.label, seed
                        same_dtype_ar = next(r.label for r in runs if r.method == "ar" and r.dtype == run.dtype)
                        record.identical_to_ar = record.output_ids == results[same_dtype_ar].output_ids
                        if fp32 is not None:
                            record.identical_to_fp32 = record.output_ids == fp32
                            record.tokens_to_first_difference = common_prefix(record.output_ids, fp32)
                        records.append(record)
                    # The next turn sees one answer for every method: the float32 target's where it ran.
                    answer = results[self._fp32_ar or serving_ar].output_ids
                    history.append({"role": "assistant", "content": self.model.tokenizer.decode(
                        answer, skip_special_tokens=True)})
            if progress:
                done = [r for r in records if r.method in SPECULATIVE]
                if done:
                    bar.set_postfix(tau=f"{sum(r.step_tokens or 0 for r in done) / max(1, sum(r.steps or 0 for r in done)):.2f}")
        return records


# ------------------------------------------------------------------------------------ summaries


Summary = dict[str, dict[str, dict[str, dict[str, Any]]]]  # benchmark -> sampling -> label -> row


def summarize(records: Sequence[Record], draft_length: int) -> Summary:
    """Per benchmark, sampling setting and method (label): τ, acceptance per position, tokens/s,
    speedups (against the fastest plain decoding in any dtype and against `ar`/`hf_generate` in the
    same dtype), time split, and agreement (with same-dtype `ar`; at T=0 with the float32 target)."""
    grouped: dict[tuple[str, str], dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        grouped[record.benchmark, record.sampling][record.label or record.method].append(record)
    summary: Summary = defaultdict(dict)
    for (benchmark, sampling), by_label in grouped.items():
        rows: dict[str, dict[str, Any]] = {}
        for label, items in by_label.items():
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
            rows[label] = {
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
        plain = [label for label, row in rows.items() if row["method"] in PLAIN and row["tokens_per_second"]]
        fastest = max(plain, key=lambda label: rows[label]["tokens_per_second"]) if plain else None
        for row in rows.values():
            if fastest is not None:
                row["fastest_plain"] = fastest
                row["speedup_vs_fastest_plain"] = row["tokens_per_second"] / rows[fastest]["tokens_per_second"]
            for base in PLAIN:
                same = next((r for r in rows.values() if r["method"] == base and r["dtype"] == row["dtype"]), None)
                if same is not None and same["tokens_per_second"]:
                    row[f"speedup_vs_{base}"] = row["tokens_per_second"] / same["tokens_per_second"]
        summary[benchmark][sampling] = rows
    return dict(summary)


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}×" if row.get(key) is not None else "–"


def _share(value: float | None) -> str:
    return f"{value * 100:.0f}%" if value is not None else "–"


def markdown_table(summary: Summary) -> str:
    """One row per benchmark, setting and method; the fastest plain decoding of each group below."""
    lines = [
        "| benchmark | setting | method | dtype | prompts | τ | tokens/s | × fastest plain | × AR (same dtype) "
        "| × HF generate (same dtype) | identical to AR (same dtype) | identical to fp32 greedy "
        "| tokens to 1st difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
                    f"{_ratio(row, 'speedup_vs_ar')} | {_ratio(row, 'speedup_vs_hf_generate')} | "
                    f"{_share(row['identical_to_ar'])} | {_share(row.get('identical_to_fp32'))} | "
                    f"{f'{first_diff:.1f}' if first_diff is not None else '–'} |"
                )
            fastest = next((row.get("fastest_plain") for row in rows.values()), None)
            if fastest:
                notes.append(f"{benchmark} {sampling}: {fastest} ({rows[fastest]['tokens_per_second']:.1f} tokens/s)")
    if notes:
        lines += ["", "Fastest plain decoding (AR or HF generate, any dtype) per benchmark and setting: "
                  + "; ".join(notes) + "."]
    return "\n".join(lines)


def save_results(
    out_dir: str | Path, records: Sequence[Record], summary: Summary, meta: dict[str, Any]
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


def plot(summary: Summary, out: Path) -> dict[str, Path]:
    """Speedup and τ per benchmark/setting and method, acceptance-length histogram, time breakdown (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}
    groups = [(b, s) for b, settings in summary.items() for s in settings]
    names = [f"{b}\n{s}" if len(groups) > len(summary) else b for b, s in groups]
    labels = list(dict.fromkeys(label for b, s in groups for label in summary[b][s]))
    width = 0.8 / max(1, len(labels))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
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
    paths["speedup_plot"] = out / "speedup_tau.png"
    fig.savefig(paths["speedup_plot"], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for (benchmark, sampling), name in zip(groups, names, strict=True):
        for label, row in summary[benchmark][sampling].items():
            hist = row.get("accept_length_histogram") if row["method"] in SPECULATIVE else None
            if hist:
                total = sum(hist)
                ax.plot(range(len(hist)), [h / total for h in hist], marker="o",
                        label=f"{name.replace(chr(10), ' ')}/{label}")
    ax.set_xlabel("draft tokens accepted per step")
    ax.set_ylabel("share of steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["acceptance_plot"] = out / "acceptance_hist.png"
    fig.savefig(paths["acceptance_plot"], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
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
    An `Eagle3Model` is fitted the same way over its dynamic tree's settings (top_k, depth, total_tokens).
    """
    for setting in grid:
        model.tree.with_overrides(setting)  # validates names and values before timing
    speculative = getattr(model, "eagle3_generate", None) or model.dart_generate
    results = []
    # Warm-up: first calls pay one-time kernel and allocator set-up that would flatter the later ones.
    model.ar_generate(prompts[0], max_new_token_num=8)
    speculative(prompts[0], max_new_token_num=8)
    for setting in grid:
        stats: dict[str, list[Any]] = {"ar": [], "dart": []}
        for i, ids in enumerate(prompts):
            for kind in ("ar", "dart") if i % 2 == 0 else ("dart", "ar"):  # alternate which goes first
                generate = model.ar_generate if kind == "ar" else partial(speculative, tree=setting)
                stats[kind].append(generate(ids, max_new_token_num=max_new_tokens, return_stats=True)[1])
        ar, dart = stats["ar"], stats["dart"]
        rate = sum(s.new_tokens for s in dart) / sum(s.wall_time for s in dart)
        speedup = rate / (sum(s.new_tokens for s in ar) / sum(s.wall_time for s in ar))
        tau = sum(sum(s.emitted) for s in dart) / sum(s.steps for s in dart)
        nodes = sum(sum(s.tree_sizes) for s in dart) / max(1, sum(len(s.tree_sizes) for s in dart))
        results.append({**setting, "tau": tau, "tree_nodes": nodes, "tokens_per_second": rate,
                        "speedup_vs_ar": speedup})
        log.info("tree %s: τ %.2f, %.1f tok/s, %.2f× AR", setting, tau, rate, speedup)
    return sorted(results, key=lambda r: r["speedup_vs_ar"], reverse=True)
