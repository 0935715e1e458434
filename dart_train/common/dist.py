"""Where this process stands in the distributed run (training, state caches, logging), and joining it."""

from __future__ import annotations

import os
import socket

import torch

__all__ = ["init_distributed", "rank_and_world_size"]


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the initialised torch.distributed process group, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> None:
    """Join (or create) the process group DeepSpeed uses; a world of one when not launched."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python`/console-script start: a single-process world
        os.environ.update(
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        )
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        # DeepSpeed's CPU backend JIT-builds its shared-memory all-reduce op here (26 s on a fresh machine,
        # every fresh clone's first dart-train) for `inference_all_reduce`, which training never calls;
        # marked unavailable, the build is skipped (DeepSpeed keeps this dict for such edits).
        from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    deepspeed.init_distributed(dist_backend=backend)
