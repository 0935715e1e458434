"""The knobs of a training run besides the model and data: optimiser, schedule, DeepSpeed, checkpoints.

The `trainer`, `optim`, `train_eval` and `logging` config groups map onto `TrainSettings`
(`dart_train.builders.settings_from_config`); invalid combinations fail here, before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainSettings"]


@dataclass
class TrainSettings:
    """Everything the engine needs besides the model and data (paper defaults, dart-method.md §2)."""

    lr: float = 2e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.02
    warmup_steps: int | None = None  # overrides warmup_ratio
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 0.5
    gamma: float = 0.6
    epochs: int = 3
    max_steps: int | None = None  # optimiser steps; overrides epochs when set
    grad_accum: int = 1
    zero_stage: int = 0
    bf16: bool = False
    # The head's forward under torch autocast in this dtype (DeepSpeed's torch_autocast: fp32 weights,
    # optimiser and loss; matmuls in bf16), e.g. "bfloat16"; None = no autocast.
    autocast_dtype: str | None = None
    max_anchors: int | None = None  # per row; None = every loss-masked anchor
    attention: str = "auto"  # auto (flex on GPU, dense on CPU) | dense | flex
    seed: int = 0
    log_every: int = 10
    eval_every: int | None = None  # optimiser steps; None = only at the end
    save_every: int | None = None  # optimiser steps; None = only at the end
    keep_last: int = 2
    progress: bool = True
    extra_ds_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.max_steps is None and self.epochs < 1:
            raise ValueError("set max_steps or epochs >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.attention not in ("auto", "dense", "flex"):
            raise ValueError(f"attention must be auto, dense or flex, got {self.attention!r}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if self.autocast_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(f"autocast_dtype must be bfloat16, float16 or None, got {self.autocast_dtype!r}")
        if self.autocast_dtype and self.bf16:
            raise ValueError("bf16 (bf16 weights) and autocast_dtype exclude each other: choose one")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
