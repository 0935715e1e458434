"""τ and wall-clock speedup of DART against the baselines, on the same prompts in the same process.

Methods (names used in configs, JSON and tables):
- `ar`: plain autoregressive decoding through our target adapter;
- `hf_generate`: transformers' own `generate` (greedy or sampling);
- `prompt_lookup`: transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`), the speculative
  decoder a transformers user already has;
- `dart`: DART with the n-gram trie; `dart_no_trie`: DART with the n-gram term switched off;
- `eagle3`: an EAGLE-3 head (a `DartModel` with that head on the same target) with EAGLE-2's dynamic
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

A run is a sequence of units (`Unit`: one prompt, turn and setting, every method); `Evaluator.run`
hands each measured unit to `save` at once and takes the units a previous run measured from `resume`
(`dart_infer.evaluation.records`). Summaries, tables, files and plots are in `dart_infer.evaluation.results`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from dart_infer.common.dtypes import dtype_name
from dart_infer.common.errors import InputError
from dart_infer.data.conversations import Conversation, chat_prompt
from dart_infer.decoding.dart_model import DartModel
from dart_infer.decoding.sampling import GREEDY_TEMPERATURE, Sampler
from dart_infer.decoding.stats import wall_clock
from dart_infer.engines.vllm.runner import VLLM_METHODS
from dart_infer.evaluation.records import Record, Unit, prompt_digest
from dart_infer.target.bf16_weights import uses_bf16_weights

log = logging.getLogger(__name__)

METHODS = ("ar", "hf_generate", "prompt_lookup", "dart", "dart_no_trie")
# vLLM engines in their own process: dart_infer.engines.vllm.runner.VLLM_METHODS.
# Need something of their own (`Evaluator(eagle3=..., vllm={...})`), so not in the default set.
EXTRA_METHODS = ("eagle3", *VLLM_METHODS)
PLAIN = ("ar", "hf_generate", "vllm")  # plain decoding: the speedup baselines
RECAST = ("ar", "hf_generate")  # the plain methods also timed in every dtype of `plain_models`
SPECULATIVE = ("dart", "dart_no_trie", "eagle3", "vllm_ngram", "vllm_dart", "vllm_dart_trie", "vllm_eagle3")
PHASES = ("prefill", "draft", "search", "verify", "bookkeeping")
_SHORT_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


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


def _dtype_label(run: _Run) -> str:
    """The dtype a run computed in; `float32 (bf16 weights)` for our methods on a model whose weights
    are rounded to bf16 (`dart_infer.target.bf16_weights`; vLLM's engines load their own weights)."""
    rounded = run.method not in VLLM_METHODS and uses_bf16_weights(run.model.base_model)
    return dtype_name(run.dtype) + (" (bf16 weights)" if rounded else "")


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
            raise InputError(f"methods: unknown method(s) {unknown}; choose from {list(METHODS + EXTRA_METHODS)}")
        if "ar" not in self.methods:
            raise InputError("methods: the 'ar' method is the speedup baseline and must be included")
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.samplings:
            raise InputError("temperature: give at least one sampling setting")
        labels = [s.label for s in self.samplings]
        if len(set(labels)) != len(labels):
            raise InputError(f"temperature: sampling settings repeat: {labels}; list each once")

    def turns(self, conversation: Conversation) -> list[dict[str, str]]:
        """The user turns a conversation is prompted with: the first, or all with `multi_turn`."""
        user_turns = [m for m in conversation.messages if m["role"] == "user"]
        return user_turns if self.multi_turn else user_turns[:1]

    def units(self, benchmark: str, conversations: Sequence[Conversation]) -> list[Unit]:
        """Every unit a run of `conversations` measures, in `Evaluator.run`'s order."""
        return [
            (benchmark, index, prompt_digest(conversation), sampling.label, turn)
            for index, conversation in enumerate(conversations)
            for sampling in self.samplings
            for turn in range(len(self.turns(conversation)))
        ]


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
    `eagle3` (a `DartModel` with an EAGLE-3 head on the same target, in the serving dtype) runs `eagle3`.
    """

    def __init__(
        self, model: DartModel, settings: EvalSettings, plain_models: Sequence[DartModel] = (), eagle3: Any = None,
        vllm: Any = None,
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
        if "eagle3" in settings.methods and (eagle3 is None or getattr(eagle3.method, "name", None) != "eagle3"
                                             or eagle3.target.dtype != serving):
            raise ValueError(f"method 'eagle3' needs an EAGLE-3 head's model in the serving dtype {serving} (eagle3_model)")
        self.vllm = dict(vllm or {})  # method -> its engine (`VllmRunner`), in the serving dtype
        missing = [m for m in settings.methods if m in VLLM_METHODS and m not in self.vllm]
        if missing:
            raise ValueError(f"methods {missing} need their vLLM engines (dart_infer.engines.vllm.runner.VllmRunner)")
        self.runs = [_Run(m, m, eagle3 if m == "eagle3" else model) for m in settings.methods]
        for other in plain_models:
            self.runs += [
                _Run(run_label(m, other.target.dtype, serving), m, other) for m in settings.methods if m in RECAST
            ]
        # The float32 reference: plain float32, not float32 arithmetic over bf16-rounded weights.
        self._fp32_ar = next((r.label for r in self.runs if r.method == "ar" and r.dtype == torch.float32
                              and _dtype_label(r) == "float32"), None)
        if (serving != torch.float32 or uses_bf16_weights(model.base_model)) and self._fp32_ar is None:
            log.warning("no float32 'ar' run: agreement with the float32 target's output is not reported")
        # Each runner: (run, prompt ids, max new tokens, sampling, seed) -> Record.
        self._runners: dict[str, Callable[[_Run, torch.Tensor, int, Sampling, int], Record]] = {
            "ar": self._run_ar,
            "hf_generate": self._run_hf,
            "prompt_lookup": partial(self._run_hf, prompt_lookup=True),
            "dart": partial(self._run_dart, tree=None),
            "dart_no_trie": partial(self._run_dart, tree={"ngram_weight": 0.0}),
            "eagle3": partial(self._run_dart, tree=None),  # the same path: the model's head is EAGLE-3's
            **{method: self._run_vllm for method in VLLM_METHODS},
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
        tree: dict[str, Any] | None,
    ) -> Record:
        out, stats = run.model.dart_generate(
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

    def _run_vllm(self, run: _Run, ids: torch.Tensor, max_new: int, sampling: Sampling, seed: int) -> Record:
        """A vLLM engine's decoding of the same prompt ids in its own process, timed there (`VllmRunner`);
        speculative ones report vLLM's own acceptance counts."""
        new, seconds, accepts = self.vllm[run.method].generate(
            ids.tolist(), max_new, sampling.temperature, sampling.top_p, sampling.top_k, seed)
        if run.model.target.device.type == "cpu":  # its processes keep a core busy for a while: wait them out
            self.vllm[run.method].wait_idle()
        extra: dict[str, Any] = {}
        if accepts is not None:
            # vLLM counts steps that had a draft; a step without one (n-gram lookup found nothing) still
            # emits one token: counted here with 0 accepted, so τ means what ours does (tokens per forward).
            accepts = accepts + [0] * max(0, len(new) - sum(accepts) - len(accepts))
            extra = {"steps": len(accepts), "step_tokens": sum(accepts) + len(accepts), "accept_lengths": accepts}
        return self._record(run, ids, torch.tensor([ids.tolist() + new]), seconds, **extra)

    @staticmethod
    def _record(run: _Run, ids: torch.Tensor, out: torch.Tensor, seconds: float, **extra: Any) -> Record:
        new = out[0, ids.numel():].tolist()
        return Record(
            benchmark="", prompt_id="", turn=0, method=run.method, prompt_tokens=ids.numel(),
            new_tokens=len(new), seconds=seconds, output_ids=new, dtype=_dtype_label(run), label=run.label,
            **extra,
        )

    # --------------------------------------------------------------------------------- running
    def warm_up(self) -> None:
        """One short generation per run (and setting): first-call costs stay out of the numbers."""
        ids = chat_prompt(self.model.tokenizer, [{"role": "user", "content": "Say hello."}])
        for run in self.runs:
            for sampling in self.settings.samplings:
                self._runners[run.method](run, ids, self.settings.warmup_tokens, sampling, self.settings.seed)

    def run(
        self, benchmark: str, conversations: Sequence[Conversation], progress: bool = True, *,
        resume: Callable[[Unit], Sequence[Record] | None] | None = None,
        save: Callable[[Unit, Sequence[Record]], None] | None = None,
    ) -> list[Record]:
        """Every unit's records, in `EvalSettings.units` order. `resume(unit)` gives a unit's records
        from an earlier run (None: measure it); `save(unit, records)` gets each unit as soon as it is
        measured. Skipped units still advance the seeds and the method rotation, so a resumed run
        measures each remaining unit exactly as an uninterrupted one would."""
        from tqdm.auto import tqdm

        records: list[Record] = []
        runs = list(self.runs)
        labels = {run.label for run in runs}
        serving_ar = next(r.label for r in runs if r.method == "ar" and r.model is self.model)
        counter = 0
        bar = tqdm(conversations, desc=f"{benchmark}", disable=not progress, unit="prompt")
        for index, conversation in enumerate(bar):
            digest = prompt_digest(conversation)
            turns = self.settings.turns(conversation)
            for sampling in self.settings.samplings:
                history: list[dict[str, str]] = [m for m in conversation.messages[:1] if m["role"] == "system"]
                for turn_index, user in enumerate(turns):
                    history.append(user)
                    seed = self.settings.seed + counter
                    shift = counter % len(runs)
                    counter += 1
                    unit: Unit = (benchmark, index, digest, sampling.label, turn_index)
                    stored = resume(unit) if resume is not None else None
                    if stored is not None and labels <= {r.label for r in stored}:
                        results = {r.label: r for r in stored}
                    else:
                        ids = chat_prompt(self.model.tokenizer, history)
                        results = {
                            run.label: self._runners[run.method](run, ids, self.settings.max_new_tokens, sampling, seed)
                            for run in runs[shift:] + runs[:shift]
                        }
                        self._annotate(results, runs, unit, conversation.id, seed, sampling)
                        if save is not None:
                            save(unit, [results[run.label] for run in runs])
                    records += [results[run.label] for run in runs]
                    # The next turn sees one answer for every method: the float32 target's where it ran.
                    answer = results[self._fp32_ar or serving_ar].output_ids
                    history.append({"role": "assistant", "content": self.model.tokenizer.decode(
                        answer, skip_special_tokens=True)})
            if progress:
                done = [r for r in records if r.method in SPECULATIVE]
                if done:
                    bar.set_postfix(tau=f"{sum(r.step_tokens or 0 for r in done) / max(1, sum(r.steps or 0 for r in done)):.2f}")
        return records

    def _annotate(
        self, results: dict[str, Record], runs: Sequence[_Run], unit: Unit, prompt_id: str, seed: int,
        sampling: Sampling,
    ) -> None:
        """Fill in where each record of a unit comes from and how its output compares with AR's."""
        fp32 = results[self._fp32_ar].output_ids if self._fp32_ar and sampling.greedy else None
        for run in runs:
            record = results[run.label]
            record.benchmark, record.prompt_id, record.turn = unit[0], prompt_id, unit[4]
            record.prompt_index, record.sampling, record.seed = unit[1], sampling.label, seed
            same_dtype_ar = next(r.label for r in runs if r.method == "ar" and r.dtype == run.dtype)
            record.identical_to_ar = record.output_ids == results[same_dtype_ar].output_ids
            if fp32 is not None:
                record.identical_to_fp32 = record.output_ids == fp32
                record.tokens_to_first_difference = common_prefix(record.output_ids, fp32)
