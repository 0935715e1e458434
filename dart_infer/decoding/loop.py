"""The decoding loop behind `DartModel` (`decode_steps`): with a draft method's drafter, draft →
tree → one verification per step; without one, plain autoregressive decoding. Both run on the same
target adapter, with the same stop rules and statistics.

One step with a drafter (dart-method.md §5; DART's drafter in steps 1-2):
1. the draft head turns the newest prefix positions into d logit rows (`DartDraftModel.draft_step`);
2. `dart_infer.tree.settings.draft_trees` turns them into a token tree (top-k → target ids → C++ search
   with the token history ending in the root, and the trie);
3. the target verifies the whole tree in one forward (`TargetModel.verify`);
4. acceptance (`dart_infer.decoding.sampling`): greedy keeps the longest root-to-leaf path that matches the
   target's argmax; sampling walks the tree with the multi-candidate rule. Both are lossless;
5. the target cache keeps only the accepted path; the accepted positions are appended to the
   draft's cache with the next step's draft forward.

Every draft method plugs in a drafter for steps 1-2 (`dart_infer.methods`: DART's `DartDrafter`,
EAGLE-3's `Eagle3Drafter` with its dynamic tree); verification, acceptance and keep-path are the same
code for all. The loop yields `StepOutput`s and handles batch size 1.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from dart_infer.decoding.sampling import Sampler, greedy_accept, sampling_accept
from dart_infer.decoding.stats import GenerationStats, PhaseTimer, StepOutput, wall_clock
from dart_infer.methods.base import Drafter

__all__ = ["decode_steps", "stop_cut"]


def stop_cut(tokens: Sequence[int], emitted: int, budget: int, eos_token_ids: Sequence[int]) -> tuple[int, bool]:
    """How many of `tokens` to emit and whether generation ends (EOS, token budget)."""
    cut, finished = len(tokens), False
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            cut, finished = i + 1, True
            break
    if emitted + cut >= budget:
        cut, finished = budget - emitted, True
    return cut, finished


class _Run:
    """One generation's bookkeeping shared by both loops: stop rules, statistics, timings.
    Made when the loop starts; its statistics become `model.last_stats` then."""

    def __init__(self, model: Any, prompt: torch.Tensor, timer: PhaseTimer, budget: int) -> None:
        self.stats = GenerationStats(prompt_tokens=prompt.numel())
        model.last_stats = self.stats
        self.timer, self.eos_token_ids, self.budget = timer, model.eos_token_ids, budget

    def emit(self, tokens: list[int], accept_length: int = 0, tree_size: int = 0, *, step: bool = True) -> StepOutput:
        """Cut `tokens` at EOS / the budget and count them; `step` records a verification step
        (DART's prefill token is not one). The output's timings are filled by `done`."""
        cut, finished = stop_cut(tokens, self.stats.new_tokens, self.budget, self.eos_token_ids)
        self.stats.new_tokens += cut
        if step:
            self.stats.accept_lengths.append(accept_length)
            self.stats.emitted.append(cut)
            self.stats.tree_sizes.append(tree_size)
        return StepOutput(tokens[:cut], accept_length, tree_size, finished)

    def done(self, output: StepOutput) -> StepOutput:
        output.timings = self.timer.take_step()
        return output

    @contextmanager
    def timed(self) -> Iterator[None]:
        try:
            with wall_clock(self.timer.device) as elapsed:
                yield
        finally:
            self.stats.wall_time = elapsed[0]
            self.stats.timings = dict(self.timer.totals)


def decode_steps(
    model: Any,
    prompt: torch.Tensor,
    budget: int,
    sampler: Sampler,
    drafter: Drafter | None,
    profile: bool,
) -> Iterator[StepOutput]:
    """THE decoding loop of `DartModel`: `prompt` (1-D) decoded with `model`'s target and EOS set,
    drafting with `drafter` (a draft method's, `dart_infer.methods`), or plainly without one. The
    statistics land in `model.last_stats`."""
    if drafter is None:
        return _plain_steps(model, prompt, budget, sampler, profile)
    return _tree_steps(model, prompt, budget, sampler, drafter, profile)


@torch.inference_mode()
def _tree_steps(
    model: Any,
    prompt: torch.Tensor,
    budget: int,
    sampler: Sampler,
    drafter: Drafter,
    profile: bool,
) -> Iterator[StepOutput]:
    """Draft-tree decoding: prefill, then per step the drafter's tree, ONE verification, acceptance
    and keep-path. The drafter's `update(aux_new [1,n,3H], next_ids_new [1,n])` takes the accepted
    prefix positions, `propose(history) -> DraftTree` (history: CPU tokens so far, ending with the
    root) is timed as its `propose_phase`."""
    target = model.target
    device = target.device
    timer = PhaseTimer(profile, device)
    run = _Run(model, prompt, timer, budget)
    n = prompt.numel()
    # Token history on the CPU (the tree search reads it): prompt + everything emitted so far.
    history = torch.empty(n + budget, dtype=torch.long)
    history[:n] = prompt
    length = n
    with run.timed():
        with timer("prefill"):
            aux, last_logits, cache = target.prefill(prompt[None].to(device))
            root = sampler.select(last_logits)
        out = run.emit([root], step=False)
        history[length] = root
        length += 1
        yield run.done(out)
        if out.finished:
            return
        with timer("draft"):
            drafter.update(aux, history[1:length][None].to(device))
        while True:
            with timer(drafter.propose_phase):
                tree = drafter.propose(history[:length])
            past = cache.get_seq_length()
            with timer("verify"):
                tree_aux, tree_logits = target.verify(tree.tokens, tree.positions, tree.mask, cache)
            with timer("bookkeeping"):
                if sampler.greedy:
                    nodes, bonus = greedy_accept(tree.tokens, tree.retrieve_indices, tree_logits)
                else:
                    nodes, bonus = sampling_accept(tree.tokens, tree.parents, tree_logits, sampler)
                target.keep_path(cache, past, nodes)
                new_tokens = tree.tokens[nodes[1:]].tolist() + [bonus]
                out = run.emit(new_tokens, len(nodes) - 1, tree.tokens.numel() - 1)
                history[length : length + len(out.tokens)] = torch.tensor(out.tokens, dtype=torch.long)
                length += len(out.tokens)
            yield run.done(out)
            if out.finished:
                return
            with timer("draft"):
                # Accepted positions (root + accepted nodes) paired with their next tokens.
                node_index = nodes.to(tree_aux.device)
                drafter.update(tree_aux[node_index][None], torch.tensor(new_tokens, device=device)[None])


@torch.inference_mode()
def _plain_steps(model: Any, prompt: torch.Tensor, budget: int, sampler: Sampler, profile: bool) -> Iterator[StepOutput]:
    """Plain autoregressive decoding through the same target adapter (one token per forward)."""
    target = model.target
    device = target.device
    timer = PhaseTimer(profile, device)
    run = _Run(model, prompt, timer, budget)
    with run.timed():
        with timer("prefill"):
            logits, cache = target.next_logits(prompt[None].to(device))
            token = sampler.select(logits)
        while True:
            out = run.emit([token])
            yield run.done(out)
            if out.finished:
                return
            with timer("verify"):
                logits, cache = target.next_logits(torch.tensor([[token]], device=device), cache)
            with timer("bookkeeping"):
                token = sampler.select(logits)
