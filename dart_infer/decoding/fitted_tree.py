"""`tree="auto"`: DART's tree size fitted to the machine it runs on, measured in seconds, cached.

How many nodes pay depends on the CPU: with AMX a 25-row verification costs about one row's, on an
AVX-512 CPU without AMX ~1.8 plain steps, on AVX2 in float32 more (issue 40). So the size is measured:

- **what each size accepts** does not depend on the machine. One short DART run with the largest
  candidate tree (`FIT_PROMPTS` ShareGPT train prompts × `FIT_NEW_TOKENS` tokens) also builds, at every
  step, the tree each smaller size would have drafted from the same draft rows. The search keeps the
  best `remain_total` nodes of one candidate pool, so these trees nest, and the target's kept tokens
  (accepted nodes + its bonus token) say how deep each would have matched: τ(n) = 1 + mean depth.
- **what each size costs** is measured here: the target's verification forward at a few row counts
  (interleaved, median), interpolated at each step's node count, plus the step's draft, search and
  bookkeeping time from the same run.

The size with the most tokens per second, τ(n) / step(n), wins (ties: the smaller). The whole fit is
kept in `<cache>/machine/tree-<key>.json`, keyed by the CPU fingerprint, the model, head, trie, dtype, the
other tree settings and, where our kernels run (bf16 weights), their `KERNELS_VERSION`; deleting it
measures again. Step costs are the eager step's: a compiled target (`compile_decoding`) compiles the
sizes this fit chose.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import json
import logging
import statistics
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dart_infer.common.files import atomic_write_bytes
from dart_infer.common.machine import cpu_fingerprint, machine_cache_dir
from dart_infer.data.assets import AssetMissingError
from dart_infer.decoding.loop import decode_steps
from dart_infer.decoding.sampling import Sampler
from dart_infer.target.adapter import TargetModel
from dart_infer.target.bf16_weights import uses_bf16_weights
from dart_infer.target.kernels import KERNELS_VERSION
from dart_infer.tree.settings import DraftTree, TreeSearchSettings, draft_trees

__all__ = ["CANDIDATE_SIZES", "TreeFit", "fit_tree_size", "model_tree_fit"]

log = logging.getLogger(__name__)

CANDIDATE_SIZES = (2, 4, 6, 8, 12, 16, 24, 32)  # remain_total values compared
FIT_PROMPTS = 4
FIT_NEW_TOKENS = 64
COST_ROUNDS = 5  # timed rounds of every row count (after one warm-up round)
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class TreeFit:
    """The fitted size and what it was chosen from (per candidate remain_total)."""

    remain_total: int
    tau: dict[int, float]  # tokens per step, bonus included
    step_ms: dict[int, float]  # predicted ms per step (verification + the step's other work)
    speedup: dict[int, float]  # predicted tokens/s ÷ plain decoding's (one verified row per token)
    steps: int  # verification steps the τ estimates average over
    seconds: float  # what the fit took when it was measured

    def summary(self) -> str:
        n = self.remain_total
        return (f"remain_total={n}: τ {self.tau[n]:.2f}, {self.step_ms[n]:.1f} ms a step, predicted "
                f"{self.speedup[n]:.2f}× plain decoding (sizes {', '.join(f'{k}: {v:.2f}×' for k, v in self.speedup.items())})")


class _ProbingDrafter:
    """A DART drafter that drafts the largest candidate tree and, from the same draft rows, the tree of
    each candidate size; the next `update` (which receives the target's kept tokens) scores them."""

    def __init__(self, inner: Any, model: Any, sizes: tuple[int, ...]) -> None:
        self.inner, self.model, self.sizes = inner, model, sizes
        self.propose_phase = inner.propose_phase
        self.pending: dict[int, DraftTree] | None = None
        self.depths: dict[int, list[int]] = {n: [] for n in sizes}
        self.nodes: dict[int, list[int]] = {n: [] for n in sizes}
        self.probe_seconds = 0.0  # the extra searches, taken out of the step's search time

    def update(self, aux_hidden_new: torch.Tensor, next_ids_new: torch.Tensor) -> None:
        if self.pending is not None:
            kept = next_ids_new[0].tolist()  # the accepted nodes' tokens, then the target's bonus token
            for n, tree in self.pending.items():
                self.depths[n].append(_matched_depth(tree, kept))
                self.nodes[n].append(tree.tokens.numel())
        self.inner.update(aux_hidden_new, next_ids_new)

    def propose(self, history: torch.Tensor) -> DraftTree:
        tree = self.inner.propose(history)
        start = time.perf_counter()
        settings = self.inner.settings
        self.pending = {
            n: draft_trees(self.inner.logits[None], self.model.draft_model, [history], trie=self.model.trie,
                           settings=dataclasses.replace(settings, remain_total=n),
                           eos_token_ids=self.model.eos_token_ids, contexts=[self.inner.context])[0]
            for n in self.sizes
        }
        self.probe_seconds += time.perf_counter() - start
        return tree


def _matched_depth(tree: DraftTree, kept: list[int]) -> int:
    """How many of `kept`'s tokens a path from the tree's root matches (what greedy acceptance keeps)."""
    children: dict[tuple[int, int], int] = {}
    for node in range(1, tree.tokens.numel()):
        children.setdefault((int(tree.parents[node]), int(tree.tokens[node])), node)
    node, depth = 0, 0
    for token in kept:
        node = children.get((node, token), -1)
        if node < 0:
            break
        depth += 1
    return depth


def _fit_prompts(tokenizer: Any, count: int) -> list[torch.Tensor]:
    """The first `count` ShareGPT train-split first turns of at most 256 tokens (never held-out data),
    under the chat template, or as plain text for a tokenizer without one (the fit only needs text)."""
    from dart_infer.data.conversations import chat_prompt, first_turn, load_conversations

    prompts = []
    quiet = logging.getLogger("dart_infer.data.conversations")
    level = quiet.level
    with warnings.catch_warnings():  # the dataset's skipped rows are no news to someone serving a model
        warnings.simplefilter("ignore")
        quiet.setLevel(logging.ERROR)
        try:
            conversations = load_conversations("sharegpt", split="train", limit=8 * count)
        finally:
            quiet.setLevel(level)
    for conversation in conversations:
        messages = first_turn(conversation)
        if getattr(tokenizer, "chat_template", None):
            ids = chat_prompt(tokenizer, messages)
        else:
            ids = torch.tensor(tokenizer(messages[-1]["content"])["input_ids"], dtype=torch.long)
        if 0 < ids.numel() <= 256:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def _verify_costs(target: Any, rows: list[int], context: int) -> dict[int, float]:
    """Median seconds of one verification forward of each row count over `context` cached tokens."""
    generator = torch.Generator().manual_seed(0)
    _, _, cache = target.prefill(torch.randint(0, target.vocab_size, (1, context), generator=generator))
    past = cache.get_seq_length()
    times: dict[int, list[float]] = {n: [] for n in rows}
    for round_ in range(COST_ROUNDS + 1):
        for n in rows if round_ % 2 else reversed(rows):
            tokens = torch.randint(0, target.vocab_size, (n,), generator=generator)
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool))  # a chain costs what any n-node tree costs
            start = time.perf_counter()
            target.verify(tokens, torch.arange(n), mask, cache)
            elapsed = time.perf_counter() - start
            target.keep_path(cache, past, [])
            if round_:  # the first round warms kernels and the allocator up
                times[n].append(elapsed)
    return {n: statistics.median(v) for n, v in times.items()}


def _interpolate(costs: dict[int, float], n: int) -> float:
    sizes = sorted(costs)
    i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)
    lo, hi = sizes[i - 1], sizes[i]
    return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)


def _cache_key(model: Any, settings: TreeSearchSettings, sizes: tuple[int, ...]) -> dict[str, Any]:
    def source(obj: Any) -> dict[str, Any]:
        path = str(getattr(obj, "name_or_path", None) or getattr(getattr(obj, "config", None), "_name_or_path", ""))
        stamp = None
        if path and Path(path).is_dir():  # a retrained head in the same directory is another head
            stamp = max((f.stat().st_mtime for f in Path(path).iterdir() if f.is_file()), default=None)
        return {"path": path, "stamp": stamp}

    trie = model.trie
    return {
        "format": FORMAT,
        "machine": cpu_fingerprint(),
        "target": source(model.base_model),
        "head": source(model.draft_model),
        "trie": None if trie is None else {"order": trie.order, "nodes": trie.num_nodes, "vocab": trie.vocab_size,
                                           "tokenizer": trie.tokenizer_fingerprint},
        "dtype": str(model.target.dtype),
        # Other step costs than plain float32 (only named when set: earlier fits keep their key).
        **({"bf16_weights": True, "kernels": KERNELS_VERSION} if uses_bf16_weights(model.base_model) else {}),
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "remain_total"},
        "sizes": list(sizes),
    }


def _cache_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return machine_cache_dir() / f"tree-{digest}.json"


def _load(path: Path, key: dict[str, Any]) -> TreeFit | None:
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        fit = saved["fit"]
        return TreeFit(int(fit["remain_total"]), *({int(k): float(v) for k, v in fit[name].items()}
                                                    for name in ("tau", "step_ms", "speedup")),
                       int(fit["steps"]), float(fit["seconds"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def model_tree_fit(model: Any, settings: TreeSearchSettings) -> TreeFit | None:
    """`DartModel.fitted_tree`: `fit_tree_size` kept on the model per device, dtype, settings and trie;
    None (said once) where the fit has no prompts, and the model then serves `settings`' size."""
    key = (model.target.device, model.target.dtype, uses_bf16_weights(model.base_model), repr(settings), id(model.trie))
    fits = model._tree_fits
    if key not in fits:
        try:
            fits[key] = fit_tree_size(model, settings)
        except AssetMissingError as err:
            log.warning("tree=auto: cannot fit the tree size here (%s); using remain_total=%d", err, settings.remain_total)
            fits[key] = None
    return fits[key]


@contextlib.contextmanager
def _eager(model: Any) -> Iterator[None]:
    """`model` decoding through the eager target and draft step while inside (a compiled one has only
    its own fixed shapes), then as it was. A background compile finishes first: it installs its steps
    when done, which this would undo on the way out."""
    compiling = getattr(model, "compiling", None)  # compile_decoding(..., background=True)
    if compiling is not None:
        compiling.wait()
    target, compiled_draft = model.target, model.__dict__.get("compiled_draft")
    if type(target) is not TargetModel:
        model.target = TargetModel(model.base_model, target.aux_layer_ids)
        model.target.embedding_weight = target.embedding_weight
    model.__dict__.pop("compiled_draft", None)
    try:
        yield
    finally:
        model.target = target
        if compiled_draft is not None:
            model.compiled_draft = compiled_draft


def fit_tree_size(model: Any, settings: TreeSearchSettings, sizes: tuple[int, ...] = CANDIDATE_SIZES) -> TreeFit:
    """The `remain_total` of `settings` (a DART tree) that decodes fastest with `model` here (see the
    module docstring); read from the cache when this machine, model, head, trie and dtype were fitted."""
    key = _cache_key(model, settings, sizes)
    path = _cache_path(key)
    cached = _load(path, key)
    if cached is not None:
        log.info("tree auto: %s (fitted on this machine before: %s)", cached.summary(), path)
        return cached
    with _eager(model):
        fit, costs = _measure(model, settings, sizes)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps({"key": key, "fit": dataclasses.asdict(fit),
                                             "verify_ms": {n: 1e3 * c for n, c in costs.items()},
                                             "measured": time.strftime("%Y-%m-%dT%H:%M:%S")},
                                            indent=2, default=str).encode())
    except OSError as err:  # a read-only cache: fit again next process
        log.warning("cannot save the tree fit to %s: %s", path, err)
    log.info("tree auto: %s; fitted in %.0f s (%s)", fit.summary(), fit.seconds, key["machine"]["cpu"])
    return fit


def _measure(model: Any, settings: TreeSearchSettings, sizes: tuple[int, ...]) -> tuple[TreeFit, dict[int, float]]:
    """The fit itself: τ of every size from one probing run, the verification's cost per row count."""
    start = time.perf_counter()
    prompts = _fit_prompts(model.tokenizer, FIT_PROMPTS)
    if not prompts:
        raise RuntimeError("tree=auto: no ShareGPT train prompt to fit the tree size with")
    largest = dataclasses.replace(settings, remain_total=max(sizes))
    sampler = Sampler(0.0)  # greedy: the target's kept tokens are its argmax path
    probes, step_seconds = [], 0.0
    for i, prompt in enumerate(prompts):  # decode_steps runs in inference mode itself
        probe = _ProbingDrafter(model.method.drafter(model, largest), model, sizes)
        for _ in decode_steps(model, prompt, FIT_NEW_TOKENS if i else 8, sampler, probe, profile=True):
            pass
        if i == 0:
            continue  # a warm-up: first calls pay one-time kernel and allocator set-up
        timings = model.last_stats.timings
        step_seconds += sum(timings.get(p, 0.0) for p in ("draft", "search", "bookkeeping")) - probe.probe_seconds
        probes.append(probe)
    total_steps = sum(len(p.depths[sizes[0]]) for p in probes)
    if total_steps == 0:
        raise RuntimeError("tree=auto: the fit's prompts ended before a second step")
    overhead = step_seconds / total_steps  # the step's work besides verification, per step
    node_counts = {n: [c for p in probes for c in p.nodes[n]] for n in sizes}
    rows = sorted({1, *(max(c) for c in node_counts.values()), *(min(c) for c in node_counts.values())})
    context = int(sum(p.numel() for p in prompts) / len(prompts)) + FIT_NEW_TOKENS // 2
    costs = _verify_costs(model.target, rows, context)
    tau = {n: 1 + sum(d for p in probes for d in p.depths[n]) / total_steps for n in sizes}
    step_ms = {n: 1e3 * (statistics.fmean(_interpolate(costs, c) for c in node_counts[n]) + overhead) for n in sizes}
    speedup = {n: tau[n] * costs[1] * 1e3 / step_ms[n] for n in sizes}
    best = max(sizes, key=lambda n: (round(speedup[n], 3), -n))
    return TreeFit(best, tau, step_ms, speedup, total_steps, time.perf_counter() - start), costs
