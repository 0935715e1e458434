"""What a generation reports: per-step outputs, per-generation statistics, a per-phase timer."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["GenerationStats", "PhaseTimer", "StepOutput", "wall_clock"]


@contextmanager
def wall_clock(device: torch.device | str) -> Iterator[list[float]]:
    """Seconds of the work inside, the device's queued work included: on CUDA (asynchronous) it
    synchronises before reading the clock at both ends. dart-eval times every method through this
    one rule; the result is in `elapsed[0]` after the block."""
    cuda = torch.device(device).type == "cuda"
    elapsed = [0.0]
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        yield elapsed
    finally:
        if cuda:
            torch.cuda.synchronize()
        elapsed[0] = time.perf_counter() - start


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


class PhaseTimer:
    """Accumulates wall time per phase; synchronises CUDA so GPU work is charged to its phase."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
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
        """This step's per-phase seconds (None when not profiling); starts the next step."""
        if not self.enabled:
            return None
        out = dict(self.step)
        self.step.clear()
        return out
