"""Offline target states, written: the target runs once over the dataset into the sharded cache.

- `cache_header(target, dataset, ...)` / `keyed_cache_dir(root, header)`: what a cache depends on,
  and the directory under `root` for it (the CLI's `states.cache_dir` is such a root).
- `precompute_states(target, dataset, out_dir, *, topk=64, shard_size=64, max_tokens=8192, ...)`:
  runs the target once over a `dart_train.data.dataset.TokenizedDataset` and writes sharded safetensors +
  `manifest.json` (layout: `dart_train.states.cache`). Call again on the same directory to resume.

Shards are written to a temporary name, fsynced, hashed and renamed, then their record is written
the same way; one file per shard lets several ranks fill one cache. A killed run leaves only whole
shards (a shard without a record is recomputed). On resume existing shards are re-hashed and any
that fail are recomputed. Before computing, the free disk space is checked against the size
the remaining shards will take.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dart_infer.common.files import atomic_path, atomic_write_bytes, sha256_file
from dart_train.common.dist import rank_and_world_size
from dart_train.states.cache import (
    CACHE_FORMAT,
    MANIFEST,
    StateCacheError,
    _read_manifest,
    _record_name,
    _shard_name,
)
from dart_train.states.source import _target_states

log = logging.getLogger(__name__)


def target_fingerprint(target: Any) -> str:
    """Hash of the target's config, aux layers and a checksum of every parameter (cheap: sums)."""
    digest = hashlib.sha256()
    digest.update(target.model.config.to_json_string(use_diff=False).encode())
    digest.update(repr(tuple(target.aux_layer_ids)).encode())
    with torch.no_grad():
        for name, parameter in target.model.named_parameters():
            p = parameter.detach().double()
            digest.update(f"{name}:{tuple(p.shape)}:{float(p.sum()):.9e}:{float(p.abs().sum()):.9e}".encode())
    return digest.hexdigest()[:32]


def cache_header(
    target: Any, dataset: Any, *, topk: int, shard_size: int, autocast_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The manifest header: everything the cached states depend on (target weights, data, settings)."""
    lengths = [int(n) for n in dataset.lengths]
    return {
        "format": CACHE_FORMAT,
        "target": target_fingerprint(target),
        "dataset": dataset.fingerprint(),
        "num_sequences": len(lengths),
        "num_tokens": sum(lengths),
        "shard_size": shard_size,
        "topk": topk,
        "hidden_size": 3 * int(target.hidden_size),
        "vocab_size": int(target.vocab_size),
        "aux_layer_ids": list(target.aux_layer_ids),
        "hidden_dtype": "bfloat16",
        "autocast_dtype": str(autocast_dtype).removeprefix("torch.") if autocast_dtype else None,
    }


def keyed_cache_dir(root: str | os.PathLike[str], header: dict[str, Any]) -> Path:
    """`root/<hash of header>`: one cache per target, data and settings, so a change makes a new cache
    and keeps the old. A cache written straight into `root` (the former layout) is used when it
    matches."""
    root = Path(root)
    legacy = _read_manifest(root) if (root / MANIFEST).is_file() else None
    if legacy is not None and all(legacy.get(k) == v for k, v in header.items()):
        return root
    return root / hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()[:16]


def _batches_by_tokens(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    order = sorted(indices, key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def precompute_states(
    target: Any,
    dataset: Any,
    out_dir: str | os.PathLike[str],
    *,
    topk: int = 64,
    shard_size: int = 64,
    max_tokens: int = 8192,
    autocast_dtype: torch.dtype | None = None,
    max_shards: int | None = None,
    verify_existing: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the target once over `dataset` into a sharded cache at `out_dir` (module doc); resumable.

    Several processes may fill one cache: process `rank` of `world_size` (default: the
    torch.distributed rank/world, else 0/1) computes shards i with i % world_size == rank, then all
    meet at a barrier when torch.distributed is initialised. `max_shards` bounds how many new shards
    this call writes (work in chunks). `verify_existing` re-hashes this rank's finished shards and
    recomputes damaged ones (else only their size is checked). Returns the manifest (header +
    finished shards + `complete`). Raises `StateCacheError` if `out_dir` is not writable, lacks the
    disk space, or holds a cache for other data, another target or other settings.
    """
    from dart_train.data.batching import collate

    if topk is None or topk < 1:
        raise ValueError("the offline cache stores the target's top-k: topk must be a positive integer")
    if shard_size < 1 or max_tokens < 1:
        raise ValueError("shard_size and max_tokens must be positive")
    default_rank, default_world = rank_and_world_size()
    rank = default_rank if rank is None else rank
    world_size = default_world if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise StateCacheError(f"cannot write the state cache to {out}: {error}") from None

    lengths = [int(n) for n in dataset.lengths]
    num_sequences = len(lengths)
    hidden = 3 * int(target.hidden_size)
    header = cache_header(target, dataset, topk=topk, shard_size=shard_size, autocast_dtype=autocast_dtype)
    manifest = _read_manifest(out)
    if manifest is None:
        # Every writer would produce the same bytes, so concurrent creation is harmless.
        atomic_write_bytes(out / MANIFEST, json.dumps(header, indent=1, sort_keys=True).encode())
        manifest = {**header, "shards": {}, "complete": False}
    else:
        different = {k: (manifest.get(k), v) for k, v in header.items() if manifest.get(k) != v}
        if different:
            raise StateCacheError(
                f"{out} holds a state cache built with other settings {different} (saved, now); "
                "use another directory or delete this one"
            )
    num_shards = (num_sequences + shard_size - 1) // shard_size
    mine = [i for i in range(num_shards) if i % world_size == rank]
    done: dict[str, Any] = manifest["shards"]
    for shard in mine:  # a damaged or half-recorded shard is recomputed, never trusted
        entry = done.get(str(shard))
        if entry is None:
            continue
        path = out / entry["file"]
        intact = path.exists() and path.stat().st_size == entry["bytes"]
        if intact and verify_existing:
            intact = sha256_file(path) == entry["sha256"]
        if not intact:
            log.warning("state cache shard %s is missing or corrupt; recomputing it", entry["file"])
            del done[str(shard)]
    todo = [i for i in mine if str(i) not in done]
    if max_shards is not None:
        todo = todo[:max_shards]
    needed = sum(
        sum(lengths[i * shard_size : (i + 1) * shard_size]) for i in todo
    ) * (2 * hidden + 8 * topk + 5)
    free = shutil.disk_usage(out).free
    if needed > free:
        raise StateCacheError(
            f"the state cache needs about {needed / 1e9:.2f} GB more at {out}, only {free / 1e9:.2f} GB are free "
            "(lower topk / max_length, use fewer conversations, or choose another cache_dir)"
        )
    started = time.perf_counter()
    for count, shard in enumerate(todo, 1):
        first, last = shard * shard_size, min(num_sequences, (shard + 1) * shard_size)
        per_sequence: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for batch_indices in _batches_by_tokens(list(range(first, last)), lengths, max_tokens):
            batch = collate([dataset[i] for i in batch_indices], 0)
            aux, values, ids = _target_states(target, batch, topk, torch.bfloat16, autocast_dtype)
            for row, index in enumerate(batch_indices):
                n = lengths[index]
                per_sequence[index] = (aux[row, :n].cpu(), values[row, :n].cpu(), ids[row, :n].cpu())
        items = [dataset[i] for i in range(first, last)]
        tensors = {
            "input_ids": torch.cat([item["input_ids"] for item in items]).to(torch.int32),
            "loss_mask": torch.cat([item["loss_mask"] for item in items]).to(torch.bool),
            "offsets": torch.tensor([0, *torch.tensor(lengths[first:last]).cumsum(0).tolist()], dtype=torch.int64),
            "aux_hidden": torch.cat([per_sequence[i][0] for i in range(first, last)]).contiguous(),
            "topk_logprobs": torch.cat([per_sequence[i][1] for i in range(first, last)]).contiguous(),
            "topk_ids": torch.cat([per_sequence[i][2] for i in range(first, last)]).to(torch.int32).contiguous(),
        }
        name = _shard_name(shard)
        with atomic_path(out / name) as tmp:
            # One metadata key: safetensors writes the metadata map in no fixed order, and identical
            # shards must be byte-identical (checksums compare runs).
            metadata = {"dart": json.dumps({"format": CACHE_FORMAT, "shard": shard, "first": first})}
            save_file(tensors, str(tmp), metadata=metadata)
            checksum = sha256_file(tmp)
        entry = {
            "shard": shard,
            "file": name,
            "sha256": checksum,
            "first": first,
            "last": last,
            "tokens": int(tensors["input_ids"].numel()),
            "bytes": (out / name).stat().st_size,
        }
        # The record is written after the shard: a shard without a record is recomputed on resume.
        atomic_write_bytes(out / _record_name(shard), json.dumps(entry, sort_keys=True).encode())
        done[str(shard)] = entry
        if progress:
            elapsed = time.perf_counter() - started
            log.info("state cache: shard %d/%d written (%d this run, %.1f s)", shard + 1, num_shards, count, elapsed)
    if world_size > 1 and rank_and_world_size()[1] == world_size:
        torch.distributed.barrier()
    manifest = _read_manifest(out)
    assert manifest is not None
    return manifest
