"""The numbers a training step logs: loss, α_j and KL per draft position, tokens/s, summed over ranks."""

from __future__ import annotations

import time
from typing import Any

import torch

from dart_train.common.dist import rank_and_world_size
from dart_train.objectives import ObjectiveOutput

__all__ = ["MetricsWindow"]


class MetricsWindow:
    """Accumulates micro-batch statistics between optimiser steps (exact α_j / KL over rows)."""

    def __init__(self, draft_length: int) -> None:
        self.d = draft_length
        self.reset()

    def reset(self) -> None:
        self.loss = 0.0
        self.micro = 0
        self.kl_sum = torch.zeros(self.d)
        self.correct = torch.zeros(self.d)
        self.rows = torch.zeros(self.d)
        self.tokens = 0
        self.loss_tokens = 0
        self.started = time.perf_counter()

    def add(self, out: ObjectiveOutput, tokens: int, loss_tokens: int) -> None:
        self.loss += float(out.loss.detach())
        self.micro += 1
        self.kl_sum += out.kl_sum.detach().float().cpu()
        self.correct += out.correct.detach().float().cpu()
        self.rows += out.rows.detach().float().cpu()
        self.tokens += tokens
        self.loss_tokens += loss_tokens

    def _all_reduce(self) -> None:
        """Sum the window over ranks: the logged numbers are the global batch's, not rank 0's share."""
        if rank_and_world_size()[1] == 1:
            return
        d = self.d
        packed = torch.cat([torch.tensor([self.loss, self.micro, self.tokens, self.loss_tokens], dtype=torch.float64),
                            self.kl_sum.double(), self.correct.double(), self.rows.double()])
        torch.distributed.all_reduce(packed)
        self.loss, self.micro, self.tokens, self.loss_tokens = (float(packed[0]), int(packed[1]), int(packed[2]),
                                                                int(packed[3]))
        self.kl_sum, self.correct, self.rows = (packed[4 : 4 + d].float(), packed[4 + d : 4 + 2 * d].float(),
                                                packed[4 + 2 * d :].float())

    def flush(self, *, lr: float, step: int) -> dict[str, Any]:
        self._all_reduce()
        seconds = max(time.perf_counter() - self.started, 1e-9)
        rows = self.rows.clamp(min=1)
        metrics: dict[str, Any] = {
            "step": step,
            "loss": self.loss / max(self.micro, 1),
            "lr": lr,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / seconds,
        }
        for j in range(self.d):
            metrics[f"alpha_{j + 1}"] = float(self.correct[j] / rows[j])
            metrics[f"kl_{j + 1}"] = float(self.kl_sum[j] / rows[j])
        self.reset()
        return metrics
