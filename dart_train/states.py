"""Target hidden states and soft labels for training: online (target in-process) or an offline cache.

API (the training engine calls a `StateSource` on every batch from `dart_train.data.collate`):

- `StateSource`: `source(batch) -> dict` returns the batch plus
    "aux_hidden"            [B,T,3Ht]  the target's aux hidden states (inputs of layers 2, L//2, L-3),
                                       `hidden_dtype` (bf16 by default in both modes), zeros at padding;
    "target_topk_logprobs"  [B,T,k]    float32 log-probabilities of the target's top-k next tokens,
                                       normalised over the FULL target vocabulary (a log-softmax of
                                       the full logits, then top-k), sorted descending; zeros at padding;
    "target_topk_ids"       [B,T,k]    int64 target token ids of those entries; zeros at padding.
  Position t holds the distribution of token t+1 given tokens ≤ t (logits[t], unshifted).
  With `topk=None` (online only) the full distribution is returned: "target_topk_logprobs" is
  [B,T,V] and "target_topk_ids" is None (ids = 0..V-1).
  `source.topk`, `source.hidden_size` (= 3Ht) describe the output.
- `OnlineStateSource(target: dart_infer.target.TargetModel, *, topk=64, hidden_dtype=torch.bfloat16,
  autocast_dtype=None)`: runs the frozen target under no_grad per batch (optionally in bf16 autocast).
- `precompute_states(target, dataset, out_dir, *, topk=64, shard_size=64, max_tokens=8192, ...)`:
  runs the target once over a `dart_train.data.TokenizedDataset` and writes sharded safetensors +
  `manifest.json` (see "Offline cache"). Call again on the same directory to resume.
- `OfflineStateSource(cache_dir, dataset=None, *, verify=True, device="cpu")`: reads that cache;
  batches are looked up by `batch["segments"]` (row, column, dataset index; packed rows hold several)
  or, without it, `batch["indices"]` (one sequence per row).

Probability mass outside the top-k: the stored log-probabilities are exact for the kept entries
(normalised with the full-vocabulary logsumexp), so the mass outside the top-k is
1 - Σ exp(logprobs), known per position but not where it goes. The training loss
(`dart_train.objective.annealed_kl_loss`) restricts the target distribution to the top-k ∩ draft
vocabulary and renormalises it there; the target's argmax (for α_j) is always entry 0 of the top-k.
With k=64 the dropped mass is small for a chat model (4.4% of SmolLM2's on loss positions).

Offline cache (`out_dir/`):
  manifest.json        format, target fingerprint, dataset fingerprint, k, sizes (the header).
  shard-00000.json     the record of a finished shard: file, sha256, sequence range, tokens, bytes.
  shard-00000.safetensors  sequences [i*shard_size, (i+1)*shard_size) of the dataset, tokens
                       concatenated: input_ids int32 [N], loss_mask bool [N], offsets int64 [n+1],
                       aux_hidden bf16 [N,3Ht], topk_logprobs float32 [N,k], topk_ids int32 [N,k].
Shards are written to a temporary name, fsynced, hashed and renamed, then their record is written
the same way; one file per shard lets several ranks fill one cache. A killed run leaves only whole
shards (a shard without a record is recomputed). On resume existing shards are re-hashed and any
that fail are recomputed; the reader checks each shard's sha256 once before use and that its
input_ids equal the dataset's. Before computing, the free disk space is checked against the size
the remaining shards will take.
Bytes per token = 2·3Ht + 8k + 5 (SmolLM2-135M, Ht=576, k=64: 3973 B/token vs 196,608 B for fp32
full logits alone).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from dart_infer.files import atomic_path, atomic_write_bytes, sha256_file
from dart_train.dist import rank_and_world_size

log = logging.getLogger(__name__)

CACHE_FORMAT = "dart-states-v1"
MANIFEST = "manifest.json"
STATE_KEYS = ("aux_hidden", "target_topk_logprobs", "target_topk_ids")


class StateSource(Protocol):
    """Adds target states to a collated batch (see module doc)."""

    topk: int | None
    hidden_size: int

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]: ...


def topk_logprobs(logits: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [...,k] float32 normalised over the full vocab, ids [...,k] int64), sorted descending."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    if k is None:
        return logprobs, None
    if not 0 < k <= logprobs.shape[-1]:
        raise ValueError(f"topk must be in 1..vocab ({logprobs.shape[-1]}), got {k}")
    values, ids = torch.topk(logprobs, k, dim=-1, sorted=True)
    return values, ids


def label_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B,T] bool: positions t whose next-token distribution is a training label (x_{t+1} is in the
    loss mask). Every row of the objective and every α_j reads only these (`build_layout`)."""
    labels = torch.zeros_like(loss_mask, dtype=torch.bool)
    labels[:, :-1] = loss_mask[:, 1:]
    return labels


def _target_states(
    target: Any,
    batch: Mapping[str, Any],
    topk: int | None,
    hidden_dtype: torch.dtype,
    autocast_dtype: torch.dtype | None,
    labels_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The one place both modes run the target: (aux [B,T,3H] hidden_dtype, logprobs, ids).

    A batch from `collate_packed` (it has "document_ids") runs with its position_ids and no attention
    mask: transformers then keeps the packed items (and the padding) apart, each item exactly as if it
    ran alone. Other batches run with their 2D padding mask. `labels_only`: the full-vocabulary
    log-softmax and top-k (~30% of a SmolLM2 states pass) only at `label_positions`, zeros elsewhere."""
    device = target.device
    autocast = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    attention_mask = batch.get("attention_mask")
    with torch.no_grad(), autocast:
        if "document_ids" in batch:
            aux, logits = target.states(batch["input_ids"], position_ids=batch["position_ids"])
        else:
            mask = attention_mask.to(device) if attention_mask is not None else None
            aux, logits = target.states(batch["input_ids"].to(device), mask)
    if labels_only and topk is not None:
        where = label_positions(batch["loss_mask"].to(logits.device))
        picked_values, picked_ids = topk_logprobs(logits[where], topk)
        values = logits.new_zeros((*where.shape, topk), dtype=torch.float32)
        ids = torch.zeros((*where.shape, topk), dtype=torch.long, device=logits.device)
        values[where], ids[where] = picked_values, picked_ids
    else:
        values, ids = topk_logprobs(logits, topk)
    aux = aux.to(hidden_dtype)
    if attention_mask is not None:
        pad = ~attention_mask.to(device=device, dtype=torch.bool)
        aux = aux.masked_fill(pad[..., None], 0)
        values = values.masked_fill(pad[..., None], 0.0)
        if ids is not None:
            ids = ids.masked_fill(pad[..., None], 0)
    return aux, values, ids


class OnlineStateSource:
    """Runs the frozen target on every batch (no grad; bf16 autocast optional). `labels_only`: soft
    labels only where training reads them (`label_positions`; zeros elsewhere) — for training, not
    for simulated τ, which follows the target's argmax past the loss mask. `compile`: run the target
    through `torch.compile` (for long runs on fixed-shape batches, i.e. packed rows)."""

    def __init__(
        self,
        target: Any,
        *,
        topk: int | None = 64,
        hidden_dtype: torch.dtype = torch.bfloat16,
        autocast_dtype: torch.dtype | None = None,
        labels_only: bool = False,
        compile: bool = False,
    ) -> None:
        self.target = target
        self.topk = topk
        self.labels_only = labels_only
        self.hidden_dtype = hidden_dtype
        self.autocast_dtype = autocast_dtype
        self.hidden_size = 3 * int(target.hidden_size)
        for parameter in target.model.parameters():  # frozen: never trained, never in an optimiser
            parameter.requires_grad_(False)
        target.model.eval()
        if compile:
            # A compiled view of the same weights, used by this source only (other users of the
            # target, e.g. simulated τ with its many shapes, stay eager). Static shapes: packed
            # rows are full-width, so it compiles once per rows-per-batch (~40 s each for SmolLM2
            # here) and then runs the target ~1.35x faster (fused norms, rotary and activations).
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
            self.target = type(target)(torch.compile(target.model, dynamic=False), target.aux_layer_ids)

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        aux, values, ids = _target_states(
            self.target, batch, self.topk, self.hidden_dtype, self.autocast_dtype, self.labels_only
        )
        return {**batch, "aux_hidden": aux, "target_topk_logprobs": values, "target_topk_ids": ids}


# ------------------------------------------------------------------------------------- offline cache


class StateCacheError(RuntimeError):
    """The offline cache is missing, incomplete, corrupt or was built for other data / another target."""


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
    from dart_train.data import collate

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
    header = {
        "format": CACHE_FORMAT,
        "target": target_fingerprint(target),
        "dataset": dataset.fingerprint(),
        "num_sequences": num_sequences,
        "num_tokens": sum(lengths),
        "shard_size": shard_size,
        "topk": topk,
        "hidden_size": hidden,
        "vocab_size": int(target.vocab_size),
        "aux_layer_ids": list(target.aux_layer_ids),
        "hidden_dtype": "bfloat16",
        "autocast_dtype": str(autocast_dtype).removeprefix("torch.") if autocast_dtype else None,
    }
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


def cache_bytes_per_token(manifest: Mapping[str, Any]) -> float:
    """Stored bytes per token of a (complete or partial) cache, from its manifest."""
    shards = manifest["shards"].values()
    tokens = sum(entry["tokens"] for entry in shards)
    return sum(entry["bytes"] for entry in shards) / max(tokens, 1)


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
