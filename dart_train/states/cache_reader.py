"""Offline target states, read: batches get the states `precompute_states` stored.

- `OfflineStateSource(cache_dir, dataset=None, *, verify=True, device="cpu")`: reads that cache;
  batches are looked up by `batch["segments"]` (row, column, dataset index; packed rows hold several)
  or, without it, `batch["indices"]` (one sequence per row).
  Output: the `StateSource` contract (`dart_train.states.source`), hidden states in bf16.

The reader checks each shard's sha256 once before use and that its input_ids equal the dataset's.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dart_infer.common.files import sha256_file
from dart_train.states.cache import MANIFEST, StateCacheError, _read_manifest


class OfflineStateSource:
    """Reads a cache written by `precompute_states`; same output as `OnlineStateSource` (module doc)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        dataset: Any | None = None,
        *,
        verify: bool = True,
        device: torch.device | str = "cpu",
        max_open_shards: int = 8,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        manifest = _read_manifest(self.cache_dir)
        if manifest is None:
            raise StateCacheError(f"no state cache at {self.cache_dir} (missing {MANIFEST}); run precompute_states")
        num_shards = (manifest["num_sequences"] + manifest["shard_size"] - 1) // manifest["shard_size"]
        if not manifest.get("complete") or len(manifest["shards"]) != num_shards:
            raise StateCacheError(
                f"the state cache at {self.cache_dir} is incomplete ({len(manifest['shards'])} of {num_shards} "
                "shards): run precompute_states again on it to finish"
            )
        if dataset is not None and (
            len(dataset) != manifest["num_sequences"] or dataset.fingerprint() != manifest["dataset"]
        ):
            raise StateCacheError(
                f"the state cache at {self.cache_dir} was built for other training data "
                "(tokenizer, template, max_length or conversations differ): rebuild it"
            )
        self.manifest = manifest
        self.dataset = dataset
        self.topk: int = int(manifest["topk"])
        self.hidden_size: int = int(manifest["hidden_size"])
        self.verify = verify
        self.device = torch.device(device)
        self.max_open_shards = max_open_shards
        self._open: OrderedDict[int, tuple[Any, list[int]]] = OrderedDict()
        self._verified: set[int] = set()

    def __len__(self) -> int:
        return int(self.manifest["num_sequences"])

    def _shard(self, shard: int) -> tuple[Any, list[int]]:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        entry = self.manifest["shards"][str(shard)]
        path = self.cache_dir / entry["file"]
        if not path.exists():
            raise StateCacheError(f"state cache shard {path} is missing: run precompute_states on {self.cache_dir}")
        if self.verify and shard not in self._verified:
            if sha256_file(path) != entry["sha256"]:
                raise StateCacheError(
                    f"state cache shard {path} is corrupt (sha256 mismatch): run precompute_states on "
                    f"{self.cache_dir} to recompute it"
                )
            self._verified.add(shard)
        try:
            handle = safe_open(str(path), framework="pt")
            offsets = handle.get_tensor("offsets").tolist()
            shapes = {key: handle.get_slice(key).get_shape() for key in ("aux_hidden", "topk_logprobs", "topk_ids")}
        except Exception as error:  # safetensors raises its own error types for damaged files
            raise StateCacheError(f"cannot read state cache shard {path}: {error}") from None
        expected = {"aux_hidden": self.hidden_size, "topk_logprobs": self.topk, "topk_ids": self.topk}
        if any(list(shapes[k]) != [offsets[-1], width] for k, width in expected.items()):
            raise StateCacheError(f"state cache shard {path} has tensor shapes {shapes}, not what the manifest says")
        if len(offsets) != entry["last"] - entry["first"] + 1:
            raise StateCacheError(f"state cache shard {path} holds {len(offsets) - 1} sequences, manifest says otherwise")
        self._open[shard] = (handle, offsets)
        if len(self._open) > self.max_open_shards:
            self._open.popitem(last=False)
        return handle, offsets

    def sequence(self, index: int) -> dict[str, torch.Tensor]:
        """Stored tensors of one dataset sequence: input_ids, aux_hidden, topk_logprobs, topk_ids."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} is outside the cache (0..{len(self) - 1})")
        shard = index // int(self.manifest["shard_size"])
        handle, offsets = self._shard(shard)
        local = index - int(self.manifest["shards"][str(shard)]["first"])
        start, end = offsets[local], offsets[local + 1]
        return {
            "input_ids": handle.get_slice("input_ids")[start:end].long(),
            "aux_hidden": handle.get_slice("aux_hidden")[start:end],
            "topk_logprobs": handle.get_slice("topk_logprobs")[start:end],
            "topk_ids": handle.get_slice("topk_ids")[start:end].long(),
        }

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        input_ids = batch["input_ids"]
        rows, width = input_ids.shape
        aux = torch.zeros(rows, width, self.hidden_size, dtype=torch.bfloat16)
        values = torch.zeros(rows, width, self.topk, dtype=torch.float32)
        ids = torch.zeros(rows, width, self.topk, dtype=torch.long)
        segments = batch.get("segments")
        if segments is None:  # one sequence per row, at column 0
            segments = [(row, 0, index) for row, index in enumerate(batch["indices"].tolist())]
        else:
            segments = segments.tolist()
        for row, start, index in segments:
            stored = self.sequence(index)
            end = start + stored["input_ids"].numel()
            if end > width or not torch.equal(stored["input_ids"], input_ids[row, start:end].cpu()):
                raise StateCacheError(
                    f"cached sequence {index} does not match the batch's tokens: the cache at "
                    f"{self.cache_dir} was built for other data"
                )
            aux[row, start:end] = stored["aux_hidden"]
            values[row, start:end] = stored["topk_logprobs"]
            ids[row, start:end] = stored["topk_ids"]
        return {
            **batch,
            "aux_hidden": aux.to(self.device),
            "target_topk_logprobs": values.to(self.device),
            "target_topk_ids": ids.to(self.device),
        }
