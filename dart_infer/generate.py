"""Lossless DART decoding: draft (one forward) → C++ tree search → ONE target forward → keep-path.

One decoding step (dart-method.md §5):
1. the draft head turns the newest prefix positions into d logit rows (`DartDraftModel.draft_step`);
2. per row the top-k draft-vocab entries, mapped to target ids and softmaxed over those k, go to
   `dart_infer.search.tree_search` with the token history (ending with the root) and the trie;
3. the target verifies the whole tree in one forward (`TargetModel.verify`);
4. acceptance: greedy keeps the longest root-to-leaf path that matches the target's argmax;
   sampling walks the tree with the multi-candidate rule (try each child x with probability p(x),
   on rejection set p(x) = 0 and renormalise, sample the bonus from what is left). Both are
   lossless: greedy output equals the target's own greedy decoding, sampled output follows the
   target's (temperature / top-k / top-p) distribution;
5. the target cache keeps only the accepted path; the accepted positions are appended to the
   draft's cache with the next step's draft forward.

Everything here handles batch size 1.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dart_infer.model import DartDraftModel, DraftKVCache
from dart_infer.target import TargetModel

# Below this temperature decoding is greedy (as in the authors' and EAGLE's code).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class TreeSearchSettings:
    """Knobs of the draft tree. The defaults are the paper's GPU setting (a 60-node tree); on a CPU
    verifying 60 nodes costs several single-token steps, so smaller trees are usually faster there."""

    draft_top_k: int = 25  # candidates per draft position
    beam_width: int = 20
    remain_total: int = 60  # nodes kept in the final tree (root excluded)
    ngram_weight: float = 0.5
    level_weight: tuple[float, ...] | None = None  # per-level weights; None = search default (l+1)^-0.7
    logit_weight: tuple[float, ...] | None = None  # None = search default 0.9^l
    ngram_on_first_level: bool = False

    def __post_init__(self) -> None:
        for name in ("draft_top_k", "beam_width", "remain_total"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ngram_weight < 0:
            raise ValueError(f"ngram_weight must be >= 0, got {self.ngram_weight}")

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> TreeSearchSettings:
        if not overrides:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown tree-search settings {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class StepOutput:
    """What one decoding step emitted. The first event of a generation is the prefill's token
    (`accept_length` 0, `tree_size` 0); each later one is a verification step."""

    tokens: list[int]
    accept_length: int  # draft tokens accepted by this step (the bonus token excluded)
    tree_size: int  # draft nodes verified (root excluded)
    finished: bool
    timings: dict[str, float] | None = None  # seconds, when profiling


@dataclass
class GenerationStats:
    """Per-generation record: τ, acceptance lengths, and (when profiling) where the time went."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per verification step, bonus excluded
    emitted: list[int] = field(default_factory=list)  # tokens emitted per verification step
    tree_sizes: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # totals in seconds (profiling only)
    wall_time: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.emitted)

    @property
    def tau(self) -> float:
        """Tokens per verification step, bonus included (the paper's average acceptance length)."""
        return sum(self.emitted) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "tau": self.tau,
            "mean_accept_length": sum(self.accept_lengths) / self.steps if self.steps else 0.0,
            "mean_tree_size": sum(self.tree_sizes) / self.steps if self.steps else 0.0,
            "wall_time": self.wall_time,
            "tokens_per_second": self.tokens_per_second,
            "timings": dict(self.timings),
        }


class _Timer:
    """Accumulates wall time per phase; synchronises CUDA so GPU work is charged to its phase."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self.step: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            self.totals[phase] += elapsed
            self.step[phase] += elapsed

    def take_step(self) -> dict[str, float] | None:
        if not self.enabled:
            return None
        out = dict(self.step)
        self.step.clear()
        return out


class Sampler:
    """The target's token distribution after temperature, top-k and top-p (0 disables each)."""

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self.generator = generator

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Probabilities [..., V] (float32) of the processed distribution."""
        scores = logits.float() / self.temperature
        if self.top_k > 0 and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if 0.0 < self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            sorted_probs = torch.softmax(sorted_scores, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
            drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= self.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return torch.softmax(scores, dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator).item())

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator).item())

    def select(self, logits: torch.Tensor) -> int:
        """The next token from one logit row: argmax when greedy, else a draw."""
        if self.greedy:
            return int(torch.argmax(logits).item())
        return self.draw(self.probs(logits))


def greedy_accept(
    draft_tokens: torch.Tensor, retrieve_indices: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Longest root-to-leaf path whose every token equals the target's argmax at its parent.

    Returns (accepted node indices, root first; the bonus token = argmax at the last accepted node).
    """
    predicted = torch.argmax(logits, dim=-1).to(draft_tokens.device)
    paths = retrieve_indices.to(draft_tokens.device)
    valid = paths >= 0
    safe = paths.clamp(min=0)
    matches = (draft_tokens[safe[:, 1:]] == predicted[safe[:, :-1]]) & valid[:, 1:]
    accepted = torch.cumprod(matches.to(torch.int64), dim=1).sum(dim=1)
    best = int(torch.argmax(accepted).item())
    length = int(accepted[best].item())
    nodes = paths[best, : length + 1]
    return nodes, int(predicted[nodes[-1]].item())


def tree_children(parents: torch.Tensor) -> list[list[int]]:
    """Children of every node in tree order (ascending node index) from the parent array (root -1)."""
    children: list[list[int]] = [[] for _ in range(parents.numel())]
    for node, parent in enumerate(parents.tolist()):
        if parent >= 0:
            children[parent].append(node)
    return children


def sampling_accept(
    draft_tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, sampler: Sampler
) -> tuple[torch.Tensor, int]:
    """Multi-candidate speculative sampling over the tree (drafts are point masses, q = 1).

    At a node with target distribution p, try each child x in tree order: accept with probability
    p(x); on rejection set p(x) = 0 and renormalise. When no child is accepted (or at a leaf) the
    bonus token is drawn from the remaining p. The emitted tokens follow the target's distribution.
    """
    tokens = draft_tokens.tolist()
    children = tree_children(parents)
    node = 0
    accepted = [0]
    probs = sampler.probs(logits[0])
    while True:
        moved = False
        for child in children[node]:
            token = tokens[child]
            p_token = float(probs[token].item())
            if p_token > 0.0 and sampler.uniform() < p_token:
                node = child
                accepted.append(child)
                probs = sampler.probs(logits[child])
                moved = True
                break
            if p_token > 0.0:
                probs = probs.clone()
                probs[token] = 0.0
                total = probs.sum()
                if total <= 0:  # only rounding can get here: p(token) was ~1 and lost the draw
                    probs[token] = 1.0
                    total = probs.sum()
                probs = probs / total
        if not moved:
            return torch.tensor(accepted, dtype=torch.long), sampler.draw(probs)


def _as_prompt(input_ids: torch.Tensor | list[int]) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"batch size 1 only: input_ids has batch {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be [1,T] or [T], got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("empty prompt: input_ids has no tokens")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {ids.dtype}")
    return ids.to(torch.long)


def _eos_ids(base_model: Any, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids as `generate()` sees them: the generation config decides when there is one."""
    generation_config = getattr(base_model, "generation_config", None)
    if generation_config is not None:
        eos = generation_config.eos_token_id
    else:
        eos = getattr(base_model.config, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def check_head_matches_target(draft: DartDraftModel, target: TargetModel) -> None:
    """Raise a ValueError naming every mismatch between a head and the base model it is paired with."""
    cfg = draft.config
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != base hidden_size {target.hidden_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(
            f"target_hidden_size {cfg.target_hidden_size} != base hidden_size {target.hidden_size}"
        )
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != base vocab_size {target.vocab_size}")
    if draft.fc.in_features != 3 * target.hidden_size:
        problems.append(f"fc takes {draft.fc.in_features} inputs, base gives 3 x {target.hidden_size}")
    if problems:
        raise ValueError("the DART head does not fit the base model: " + "; ".join(problems))


def check_trie_matches_tokenizer(trie: Any, tokenizer: Any, vocab_size: int) -> None:
    """Raise `NgramMismatchError` (a ValueError) if the trie was built with another tokenizer
    (stored fingerprint) or holds ids beyond the base model's vocabulary."""
    from dart_infer.assets import tokenizer_fingerprint

    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    trie.check_compatible(vocab_size=vocab_size, tokenizer_fingerprint=fingerprint)


def load_draft_model(path: str | Path, *, dtype: torch.dtype | None = None) -> DartDraftModel:
    """Load a head saved by us or by the authors; any missing, unreadable or mis-shaped tensor is an error."""
    from dart_infer.assets import resolve_model

    source = resolve_model(path)
    local = Path(source)
    if local.exists():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"DART head directory {local} has no config.json")
        if not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
            raise FileNotFoundError(f"DART head directory {local} has no weights (model.safetensors)")
    try:
        model, info = DartDraftModel.from_pretrained(source, output_loading_info=True, dtype=dtype)
    except Exception as err:  # transformers/safetensors raise many types for a bad checkpoint
        raise ValueError(f"cannot load the DART head from '{source}': {err}") from err
    missing = list(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if missing or mismatched:
        raise ValueError(f"incomplete DART head at '{source}': missing {missing}, mismatched {mismatched}")
    return model


def load_trie(path: str | Path, is_small_ngram: bool = False, mmap: bool = True) -> Any:
    """An `ngram_builder.NgramTrie` from a file, or from a directory holding full/small tries.

    In a directory (the authors' release layout, or a `dart-ngram` output dir) `is_small_ngram`
    picks small over full, and for the same size the compact `.ngt` wins over the original `.trie`
    (memory-mapped: sub-ms load instead of seconds). `mmap=False` reads a compact trie into memory
    with its query index instead (faster queries, see `NgramTrie.load`).
    """
    from ngram_builder import NgramTrie

    location = Path(path)
    if location.is_dir():
        sizes = ("small", "full") if is_small_ngram else ("full", "small")
        names = [f"{size}.{ext}" for size in sizes for ext in ("ngt", "trie")]
        found = [location / n for n in names if (location / n).is_file()]
        found += sorted(p for p in (*location.glob("*.ngt"), *location.glob("*.trie")) if p not in found)
        if not found:
            raise FileNotFoundError(f"no .ngt or .trie file in {location}")
        location = found[0]
    elif not location.is_file():
        raise FileNotFoundError(f"n-gram trie not found: {location}")
    return NgramTrie.open(location, mmap=mmap)  # either format: the project's compact one or the original


class DartModel(nn.Module):
    """A base (target) model + a DART head + an optional n-gram trie, with DART decoding.

    Mirrors the authors' API (`from_pretrained`, `.tokenizer`, `.dart_generate`). Batch size 1:
    `input_ids` is one prompt, [1,T] or [T]. Outputs are prompt + new tokens, like `generate()`.
    """

    def __init__(
        self,
        base_model: Any,
        draft_model: DartDraftModel,
        tokenizer: Any = None,
        trie: Any = None,
        *,
        tree: TreeSearchSettings | Mapping[str, Any] | None = None,
        profile: bool = False,
    ) -> None:
        super().__init__()
        self.base_model = base_model
        self.draft_model = draft_model
        self.tokenizer = tokenizer
        self.trie = trie
        self.profile = profile
        self.tree = (
            tree if isinstance(tree, TreeSearchSettings) else TreeSearchSettings().with_overrides(tree)
        )
        self.target = TargetModel(base_model, draft_model.config.aux_layer_ids)
        check_head_matches_target(draft_model, self.target)
        if trie is not None:
            check_trie_matches_tokenizer(trie, tokenizer, self.target.vocab_size)
        self.eos_token_ids = _eos_ids(base_model, tokenizer)
        self.last_stats: GenerationStats | None = None
        self._attach_embedding()

    @classmethod
    def from_pretrained(
        cls,
        base_model_name_or_path: str,
        dart_model_name_or_path: str,
        ngram_model_name_or_path: str | None = None,
        is_small_ngram: bool = False,
        *,
        ngram_mmap: bool = True,
        tree: TreeSearchSettings | Mapping[str, Any] | None = None,
        profile: bool = False,
        **kwargs: Any,
    ) -> DartModel:
        """Load base model (kwargs such as `torch_dtype`/`dtype`, `device_map` go to its loader),
        tokenizer, head and trie. Names go through `dart_infer.assets.resolve_model`, so the
        embedded "smollm2-135m-instruct" works offline. `ngram_mmap=False` reads the trie into
        memory with its query index (faster trie queries, slower load; see `NgramTrie.load`)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dart_infer.assets import resolve_model

        base_path = resolve_model(base_model_name_or_path)
        kwargs.setdefault("attn_implementation", "sdpa")
        base_model = AutoModelForCausalLM.from_pretrained(base_path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(base_path)
        draft = load_draft_model(dart_model_name_or_path)
        weight = base_model.get_input_embeddings().weight
        draft = draft.to(device=weight.device, dtype=weight.dtype)
        trie = None
        if ngram_model_name_or_path is not None:
            trie = load_trie(resolve_model(ngram_model_name_or_path), is_small_ngram, mmap=ngram_mmap)
        model = cls(base_model, draft, tokenizer, trie, tree=tree, profile=profile)
        return model.eval()

    # ------------------------------------------------------------------------------ plumbing
    def _attach_embedding(self) -> None:
        self.draft_model.set_target_embedding(self.target.model.get_input_embeddings().weight)
        self.target.embedding_weight = self.target.model.get_input_embeddings().weight

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> DartModel:
        # .to()/.cuda()/.half() replace the target's embedding tensor: re-share it with the head.
        super()._apply(fn, *args, **kwargs)
        self._attach_embedding()
        return self

    def _budget(self, prompt: torch.Tensor, max_new_token_num: int, max_length: int) -> int:
        if max_new_token_num < 1:
            raise ValueError(f"max_new_token_num must be >= 1, got {max_new_token_num}")
        if max_length <= prompt.numel():
            raise ValueError(
                f"max_length ({max_length}) must exceed the prompt length ({prompt.numel()} tokens)"
            )
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.target.vocab_size:
            raise ValueError(f"input_ids hold ids outside the vocabulary [0, {self.target.vocab_size})")
        return min(max_new_token_num, max_length - prompt.numel())

    def _stop_cut(self, tokens: list[int], emitted: int, budget: int) -> tuple[int, bool]:
        """How many of `tokens` to emit and whether generation ends (EOS, token budget)."""
        cut, finished = len(tokens), False
        for i, token in enumerate(tokens):
            if token in self.eos_token_ids:
                cut, finished = i + 1, True
                break
        if emitted + cut >= budget:
            cut, finished = budget - emitted, True
        return cut, finished

    # ------------------------------------------------------------------------------ DART decoding
    def dart_generate_stream(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        tree: TreeSearchSettings | Mapping[str, Any] | None = None,
        profile: bool | None = None,
    ) -> Iterator[StepOutput]:
        """Yield each step's emitted tokens and acceptance length. Arguments as `dart_generate`;
        they are checked before the first token is computed. Stats land in `self.last_stats`."""
        prompt = _as_prompt(input_ids)
        budget = self._budget(prompt, max_new_token_num, max_length)
        sampler = Sampler(temperature, top_p, top_k, generator)
        settings = tree if isinstance(tree, TreeSearchSettings) else self.tree.with_overrides(tree)
        from dart_infer.search import tree_search  # C++ extension; imported when first needed

        return self._dart_steps(
            prompt, budget, sampler, settings, tree_search, self.profile if profile is None else profile
        )

    @torch.no_grad()
    def _dart_steps(
        self,
        prompt: torch.Tensor,
        budget: int,
        sampler: Sampler,
        settings: TreeSearchSettings,
        tree_search: Any,
        profile: bool,
    ) -> Iterator[StepOutput]:
        target, draft = self.target, self.draft_model
        device = target.device
        timer = _Timer(profile, device)
        stats = GenerationStats(prompt_tokens=prompt.numel())
        self.last_stats = stats
        start = time.perf_counter()
        n = prompt.numel()
        # Token history on the CPU (the tree search reads it): prompt + everything emitted so far.
        history = torch.empty(n + budget, dtype=torch.long)
        history[:n] = prompt
        length = n
        top_k = min(settings.draft_top_k, draft.config.draft_vocab_size)
        search_kwargs: dict[str, Any] = dict(
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            beam_width=settings.beam_width,
            remain_total=settings.remain_total,
            ngram_weight=settings.ngram_weight if self.trie is not None else 0.0,
            ngram_on_first_level=settings.ngram_on_first_level,
        )
        if settings.level_weight is not None:
            search_kwargs["level_weight"] = list(settings.level_weight)
        if settings.logit_weight is not None:
            search_kwargs["logit_weight"] = list(settings.logit_weight)
        try:
            with timer("prefill"):
                aux, last_logits, cache = target.prefill(prompt[None].to(device))
                root = sampler.select(last_logits)
            history[length] = root
            length += 1
            stats.new_tokens = 1
            finished = root in self.eos_token_ids or budget <= 1
            yield StepOutput([root], 0, 0, finished, timer.take_step())
            if finished:
                return
            draft_cache = DraftKVCache()
            with timer("draft"):
                draft_logits = draft.draft_step(aux, history[1:length][None].to(device), draft_cache)
            while True:
                with timer("search"):
                    top = torch.topk(draft_logits.float(), top_k, dim=-1)
                    candidates = draft.draft_to_target(top.indices).cpu()
                    probs = torch.softmax(top.values, dim=-1).cpu()
                    draft_tokens, retrieve, tree_mask, positions, parents = tree_search(
                        candidates, probs, self.trie, history[:length], return_parents=True, **search_kwargs
                    )
                past = cache.get_seq_length()
                with timer("verify"):
                    tree_aux, tree_logits = target.verify(draft_tokens, positions, tree_mask, cache)
                with timer("bookkeeping"):
                    if sampler.greedy:
                        nodes, bonus = greedy_accept(draft_tokens, retrieve, tree_logits)
                    else:
                        nodes, bonus = sampling_accept(draft_tokens, parents, tree_logits, sampler)
                    target.keep_path(cache, past, nodes)
                    new_tokens = draft_tokens[nodes[1:]].tolist() + [bonus]
                    cut, finished = self._stop_cut(new_tokens, stats.new_tokens, budget)
                    emitted = new_tokens[:cut]
                    history[length : length + cut] = torch.tensor(emitted, dtype=torch.long)
                    length += cut
                stats.new_tokens += cut
                stats.accept_lengths.append(len(nodes) - 1)
                stats.emitted.append(cut)
                stats.tree_sizes.append(draft_tokens.numel() - 1)
                yield StepOutput(
                    emitted, len(nodes) - 1, draft_tokens.numel() - 1, finished, timer.take_step()
                )
                if finished:
                    return
                with timer("draft"):
                    # Accepted positions (root + accepted nodes) paired with their next tokens.
                    node_index = nodes.to(tree_aux.device)
                    draft_logits = draft.draft_step(
                        tree_aux[node_index][None], torch.tensor(new_tokens, device=device)[None], draft_cache
                    )
        finally:
            stats.wall_time = time.perf_counter() - start
            stats.timings = dict(timer.totals)

    def dart_generate(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        tree: TreeSearchSettings | Mapping[str, Any] | None = None,
        profile: bool | None = None,
        return_stats: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, GenerationStats]:
        """DART decoding of ONE prompt → LongTensor [1, prompt + new] (batch size 1).

        temperature < 1e-5 is greedy (identical to the base model's greedy decoding in fp32);
        otherwise tokens follow the target's distribution after temperature, top_k (0 = off) and
        top_p (0 = off). Stops at EOS, after `max_new_token_num` new tokens, or at `max_length`
        total tokens. `tree` overrides tree-search settings for this call (e.g. {"remain_total": 16}).
        `return_stats` also returns the GenerationStats (τ, acceptance lengths, timings).
        """
        steps = self.dart_generate_stream(
            input_ids,
            temperature,
            top_p,
            top_k,
            max_new_token_num,
            max_length,
            generator=generator,
            tree=tree,
            profile=profile,
        )
        return self._collect(input_ids, steps, return_stats)

    # --------------------------------------------------------------------- autoregressive baseline
    def ar_generate_stream(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        profile: bool | None = None,
    ) -> Iterator[StepOutput]:
        """Plain autoregressive decoding through the same target adapter (one token per forward)."""
        prompt = _as_prompt(input_ids)
        budget = self._budget(prompt, max_new_token_num, max_length)
        sampler = Sampler(temperature, top_p, top_k, generator)
        return self._ar_steps(prompt, budget, sampler, self.profile if profile is None else profile)

    @torch.no_grad()
    def _ar_steps(
        self, prompt: torch.Tensor, budget: int, sampler: Sampler, profile: bool
    ) -> Iterator[StepOutput]:
        target = self.target
        device = target.device
        timer = _Timer(profile, device)
        stats = GenerationStats(prompt_tokens=prompt.numel())
        self.last_stats = stats
        start = time.perf_counter()
        try:
            with timer("prefill"):
                logits, cache = target.next_logits(prompt[None].to(device))
                token = sampler.select(logits)
            while True:
                cut, finished = self._stop_cut([token], stats.new_tokens, budget)
                stats.new_tokens += cut
                stats.emitted.append(cut)
                stats.accept_lengths.append(0)
                stats.tree_sizes.append(0)
                yield StepOutput([token], 0, 0, finished, timer.take_step())
                if finished:
                    return
                with timer("verify"):
                    logits, cache = target.next_logits(torch.tensor([[token]], device=device), cache)
                with timer("bookkeeping"):
                    token = sampler.select(logits)
        finally:
            stats.wall_time = time.perf_counter() - start
            stats.timings = dict(timer.totals)

    def ar_generate(
        self,
        input_ids: torch.Tensor | list[int],
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        max_new_token_num: int = 512,
        max_length: int = 2048,
        *,
        generator: torch.Generator | None = None,
        profile: bool | None = None,
        return_stats: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, GenerationStats]:
        """Autoregressive baseline with the same arguments and output as `dart_generate`."""
        steps = self.ar_generate_stream(
            input_ids,
            temperature,
            top_p,
            top_k,
            max_new_token_num,
            max_length,
            generator=generator,
            profile=profile,
        )
        return self._collect(input_ids, steps, return_stats)

    def _collect(
        self, input_ids: torch.Tensor | list[int], steps: Iterator[StepOutput], return_stats: bool
    ) -> torch.Tensor | tuple[torch.Tensor, GenerationStats]:
        prompt = _as_prompt(input_ids)
        new: list[int] = []
        for step in steps:
            new.extend(step.tokens)
        out = torch.cat([prompt, torch.tensor(new, dtype=torch.long)])[None]
        device = input_ids.device if isinstance(input_ids, torch.Tensor) else torch.device("cpu")
        out = out.to(device)
        if return_stats:
            assert self.last_stats is not None
            return out, self.last_stats
        return out
