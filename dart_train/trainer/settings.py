"""The knobs of a training run besides the model and data: optimiser, schedule, DeepSpeed, checkpoints.

The `optim`, `trainer` and `logging` config groups are structured configs: `OptimConfig`,
`TrainerConfig` and `LoggingConfig` have exactly the keys of `configs/<group>/*.yaml`, and
`from_group` reads a group into one (types converted, an unknown key refused). `TrainSettings`, what
the engine reads and a checkpoint records, *is* `OptimConfig` plus the engine's part of the trainer
group (`EngineConfig`) plus what is decided across groups; so a new optimiser or engine key is one
yaml key and one field here, and reaches the engine by its name. Invalid combinations fail in
`TrainSettings`, before anything loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from dart_infer.common.errors import InputError

__all__ = ["CONFIG_KEYS", "EngineConfig", "LoggingConfig", "OptimConfig", "TrainSettings", "TrainerConfig",
           "WandbConfig", "from_group"]

T = TypeVar("T")


@dataclass
class OptimConfig:
    """`configs/optim/*.yaml`, key for key (the paper's recipe, dart-method.md §2)."""

    lr: float = 2e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.02
    warmup_steps: int | None = None  # overrides warmup_ratio
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 0.5
    epochs: int = 3
    gamma: float = 0.6  # `draft.gamma` overrides it (`dart_train.builders.loss_gamma`)


@dataclass
class EngineConfig:
    """The keys of `configs/trainer/*.yaml` the engine reads (and a checkpoint records)."""

    zero_stage: int = 0
    bf16: bool = False
    grad_accum: int = 1
    max_steps: int | None = None  # optimiser steps; overrides epochs when set
    # Wall-clock minutes of train() in this process (a resumed run gets a fresh budget): the run ends at
    # the end of the optimiser step that reaches it, as at max_steps. None/0 = no time limit. The LR
    # schedule stays the one of max_steps (not rescaled to the steps reached).
    max_minutes: float | None = None
    max_anchors: int | None = None  # per row; None = every loss-masked anchor
    attention: str = "auto"  # auto (flex on GPU, dense on CPU) | dense | flex
    save_every: int | None = None  # optimiser steps; None = only at the end
    keep_last: int = 2


@dataclass
class TrainerConfig(EngineConfig):
    """`configs/trainer/*.yaml`, key for key: the engine's keys, the batching and the head's autocast.
    Defaults of the keys added later are what a run saved before them meant."""

    autocast: str | None = None  # auto | bfloat16 | float16 | null: TrainSettings.autocast_dtype, resolved
    max_tokens: int | None = None
    batch_size: int | None = None
    pack_length: int | None = None
    skip_batches: int = 0


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: str | None = None
    project: str = "dart"
    name: str | None = None


@dataclass
class LoggingConfig:
    """`configs/logging/*.yaml`, key for key."""

    log_every: int = 10
    progress: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


_EXPECTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def from_group(cls: type[T], node: DictConfig | dict[str, Any]) -> T:
    """A config group's node as its structured config `cls`: interpolations resolved, types converted,
    a key `cls` does not have refused (OmegaConf's ConfigKeyError), a value of the wrong type refused in
    one line naming the key (`InputError`: `trainer.max_minutes=soon: expected a number`)."""
    values = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except ValidationError as err:
        group = node._get_full_key(None) if isinstance(node, DictConfig) else ""
        key = f"{group}.{err.full_key}" if group else str(err.full_key)
        kind = re.search(r"converted to (\w+)", str(err))
        expected = _EXPECTED.get(kind.group(1)) if kind else None
        why = f"expected {expected}" if expected else " ".join(str(err.msg).split())
        raise InputError(f"{key}={'null' if err.value is None else err.value}: {why}") from err


@dataclass
class TrainSettings(EngineConfig, OptimConfig):
    """Everything the engine needs besides the model and data: `OptimConfig` and `EngineConfig` field
    for field, and the settings decided across groups (`dart_train.builders.settings_from_config`)."""

    # The head's forward under torch autocast in this dtype (DeepSpeed's torch_autocast: fp32 weights,
    # optimiser and loss; matmuls in bf16), e.g. "bfloat16"; None = no autocast.
    autocast_dtype: str | None = None
    seed: int = 0
    log_every: int = 10
    eval_every: int | None = None  # optimiser steps; None = only at the end
    progress: bool = True
    extra_ds_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_groups(cls, *groups: Any, **decided: Any) -> TrainSettings:
        """Every field from the first of `groups` (structured configs) that has one of its name, then
        `decided` (values that depend on more than one key)."""
        names = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for group in groups:
            for f in fields(group):
                if f.name in names:
                    values.setdefault(f.name, getattr(group, f.name))
        return cls(**{**values, **decided})

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
        if self.max_minutes is not None and not self.max_minutes >= 0:  # also refuses nan
            raise ValueError(f"max_minutes must be >= 0 (0 or None: no time limit), got {self.max_minutes}")
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
        self.save_every = self.save_every or None  # 0: only at the end, as None
        self.max_minutes = float(self.max_minutes) if self.max_minutes else None  # 0: no time limit, as None


# The config key of each TrainSettings field, for messages: the group whose structured config has it,
# or the key it is decided from.
CONFIG_KEYS: dict[str, str] = {
    **{f.name: f"logging.{f.name}" for f in fields(LoggingConfig)},
    **{f.name: f"trainer.{f.name}" for f in fields(EngineConfig)},
    **{f.name: f"optim.{f.name}" for f in fields(OptimConfig)},
    "autocast_dtype": "trainer.autocast", "eval_every": "train_eval.every", "seed": "seed",
}
