"""Where this process stands in the distributed run (training, state caches, logging)."""

from __future__ import annotations

import torch

__all__ = ["rank_and_world_size"]


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the initialised torch.distributed process group, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
