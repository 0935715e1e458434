"""The target's token distribution and the two lossless acceptance rules over a verified tree.

- `Sampler`: temperature, top-k and top-p through transformers' own logits warpers (the ones
  `generate()` applies, in its order), plus the draws and the greedy choice;
- `greedy_accept`: the longest root-to-leaf path that matches the target's argmax;
- `sampling_accept`: the multi-candidate rule (try each child x with probability p(x), on
  rejection set p(x) = 0 and renormalise, sample the bonus from what is left), so emitted tokens
  follow the target's processed distribution.
"""

from __future__ import annotations

import math
import numbers

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__all__ = ["GREEDY_TEMPERATURE", "Sampler", "greedy_accept", "sampling_accept", "tree_children"]

# Below this temperature decoding is greedy (as in the authors' and EAGLE's code).
GREEDY_TEMPERATURE = 1e-5


class Sampler:
    """The target's token distribution after temperature, top-k and top-p (0 disables each)."""

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        _check_number("temperature", temperature)
        if not (math.isfinite(temperature) and temperature >= 0):  # NaN and inf fail here too
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
        _check_number("top_p", top_p)
        if not 0.0 <= top_p <= 1.0:  # NaN fails here too
            raise ValueError(f"top_p must be in [0, 1] (0 = off), got {top_p}")
        if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool):
            raise TypeError(f"top_k must be an int >= 0 (0 = off), got {top_k!r} ({type(top_k).__name__})")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self.generator = generator
        # generate()'s order: temperature, then top-k, then top-p. Called directly rather than
        # through a LogitsProcessorList, which inspects every processor's signature on each call.
        self._warpers: list[TemperatureLogitsWarper | TopKLogitsWarper | TopPLogitsWarper] = []
        if self.temperature > 0:
            self._warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            self._warpers.append(TopKLogitsWarper(self.top_k))
        if 0.0 < self.top_p < 1.0:
            self._warpers.append(TopPLogitsWarper(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Probabilities [..., V] (float32) of the processed distribution (temperature > 0)."""
        if self.temperature == 0:
            raise ValueError("a temperature-0 (greedy) sampler has no distribution to sample from")
        scores = logits.float().reshape(-1, logits.shape[-1])  # the warpers take [batch, V]
        for warper in self._warpers:
            scores = warper(None, scores)
        return torch.softmax(scores, dim=-1).reshape(logits.shape)

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator).item())

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator).item())

    def select(self, logits: torch.Tensor) -> int:
        """The next token from one logit row: argmax when greedy, else a draw."""
        if self.greedy:
            return int(greedy_tokens(logits.reshape(-1)).item())
        return self.draw(self.probs(logits))


def _check_number(name: str, value: object) -> None:
    """A real number (an int or a float, not a bool or a string), or a TypeError naming `name`."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim, the lowest index among ties (as `generate`'s torch.argmax).

    `max(dim).indices` gives the same ids on CPU (ties included: tests/test_sampling.py checks it,
    so a torch change that breaks it fails there) and is 2-4x faster than torch.argmax for a
    [nodes, 49152] row block in bf16 and fp32 on this CPU, which every greedy step pays.
    """
    return logits.max(dim=-1).indices


def greedy_accept(
    draft_tokens: torch.Tensor, retrieve_indices: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Longest root-to-leaf path whose every token equals the target's argmax at its parent.

    Returns (accepted node indices, root first; the bonus token = argmax at the last accepted node).
    """
    predicted = greedy_tokens(logits).to(draft_tokens.device)
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
