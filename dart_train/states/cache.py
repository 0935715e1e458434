"""The offline state cache's layout: its files, header and shard records, shared by writer and reader.

Offline cache (`out_dir/`):
  manifest.json        format, target fingerprint, dataset fingerprint, k, sizes (the header).
  shard-00000.json     the record of a finished shard: file, sha256, sequence range, tokens, bytes.
  shard-00000.safetensors  sequences [i*shard_size, (i+1)*shard_size) of the dataset, tokens
                       concatenated: input_ids int32 [N], loss_mask bool [N], offsets int64 [n+1],
                       aux_hidden bf16 [N,3Ht], topk_logprobs float32 [N,k], topk_ids int32 [N,k].
Bytes per token = 2·3Ht + 8k + 5 (SmolLM2-135M, Ht=576, k=64: 3973 B/token vs 196,608 B for fp32
full logits alone).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_FORMAT = "dart-states-v1"
MANIFEST = "manifest.json"


class StateCacheError(RuntimeError):
    """The offline cache is missing, incomplete, corrupt or was built for other data / another target."""


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _record_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def _read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """Header (`manifest.json`) + the records of all finished shards (`shard-*.json`), or None."""
    path = out_dir / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise StateCacheError(f"{path} is not valid JSON ({error}); delete the cache directory to rebuild it") from None
    if manifest.get("format") != CACHE_FORMAT:
        raise StateCacheError(f"{path}: unknown cache format {manifest.get('format')!r} (expected {CACHE_FORMAT})")
    shards: dict[str, Any] = {}
    for record in sorted(out_dir.glob("shard-*.json")):
        try:
            entry = json.loads(record.read_text())
            shards[str(int(entry["shard"]))] = entry
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("ignoring unreadable state cache record %s (its shard will be recomputed)", record)
    num_shards = (manifest["num_sequences"] + manifest["shard_size"] - 1) // manifest["shard_size"]
    manifest["shards"] = {k: v for k, v in shards.items() if 0 <= int(k) < num_shards}
    manifest["complete"] = len(manifest["shards"]) == num_shards
    return manifest


def cache_bytes_per_token(manifest: Mapping[str, Any]) -> float:
    """Stored bytes per token of a (complete or partial) cache, from its manifest."""
    shards = manifest["shards"].values()
    tokens = sum(entry["tokens"] for entry in shards)
    return sum(entry["bytes"] for entry in shards) / max(tokens, 1)
