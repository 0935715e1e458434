"""The learning-rate schedule of a training run (a LambdaLR multiplier)."""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["cosine_with_warmup"]


def cosine_with_warmup(total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> Callable[[int], float]:
    """LR multiplier: linear warm-up from 1/warmup to 1, then cosine down to `min_lr_ratio`.

    Kept by hand on purpose: transformers' `get_cosine_with_min_lr_schedule_with_warmup` gives the
    same cosine part but warms up from 0 (step 0 trains at lr 0: 0, 1/W, ... instead of 1/W, 2/W, ...)
    and DeepSpeed's `WarmupCosineLR` (linear) also starts at 0 and reaches the cosine one step early
    (measured with W=2, T=10, min 0.1). Either would change the schedule of existing runs and of
    resumed checkpoints.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
