"""Batches: collation (padded or packed rows), length-bucketed and packed samplers, resumable order.

API (used by `dart_train.states`, `dart_train.trainer.simulated_tau`, the training engine and the `dart-train` CLI):

- `LengthBucketBatchSampler(lengths, *, max_tokens=None, batch_size=None, seed=0, shuffle=True,
  rank=0, world_size=1)`: batches of similar lengths, deterministic per (seed, epoch).
- `ResumableLoader(dataset, batch_sampler)`: iterate batches (collated, no worker processes);
  `state_dict()` / `load_state_dict()` restore the exact position (epoch + batches consumed), so a
  resumed run sees exactly the batches an uninterrupted run would have seen next; `skip(n)` moves
  past n batches unread (a head continued from another run starts on the data that run did not use).
- `collate(items, pad_token_id=0)` → `{"input_ids" [B,T] long, "loss_mask" [B,T] bool,
  "attention_mask" [B,T] bool (True = real token), "position_ids" [B,T] long, "lengths" [B],
  "indices" [B] (dataset indices: the offline state cache is looked up by them)}`. Right padding,
  so real tokens keep positions 0..len-1 and causal attention never sees a pad.
- `collate_packed(rows, pad_token_id=0, width=None)` and `PackedBatchSampler(lengths, *, row_tokens, ...)`:
  several sequences per row, kept apart by position ids and document ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch


def collate(items: Sequence[Mapping[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of dataset items into a batch, one sequence per row (module doc)."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    return collate_packed([[item] for item in items], pad_token_id)


def collate_packed(
    rows: Sequence[Sequence[Mapping[str, Any]]], pad_token_id: int = 0, width: int | None = None
) -> dict[str, torch.Tensor]:
    """Rows of several dataset items each, concatenated and right-padded (to `width` if given).

    Besides `collate`'s fields: "document_ids" [B,T] (the item's slot in its row; padding gets its
    own id), "segments" [N,3] (row, first column, dataset index) of every item. "position_ids"
    restart at 0 for every item and for the padding, so a causal LM given position_ids and no
    attention mask (transformers detects packed rows from them) keeps the items apart, and the draft's
    layout (`build_layout(document_ids=...)`) never attends or predicts across items. "lengths" are
    the rows' real tokens, "indices" the items' dataset indices in row order.
    """
    if not rows or not all(rows):
        raise ValueError("cannot collate an empty batch or an empty row")
    lengths = torch.tensor([sum(int(item["input_ids"].numel()) for item in row) for row in rows], dtype=torch.long)
    batch, longest = len(rows), int(lengths.max())
    if width is not None and width < longest:
        raise ValueError(f"a packed row holds {longest} tokens, more than width={width}")
    width = longest if width is None else width
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros(batch, width, dtype=torch.bool)
    position_ids = torch.zeros(batch, width, dtype=torch.long)
    document_ids = torch.zeros(batch, width, dtype=torch.long)
    segments = []
    for r, row in enumerate(rows):
        start = 0
        for doc, item in enumerate(row):
            n = int(item["input_ids"].numel())
            input_ids[r, start : start + n] = item["input_ids"]
            loss_mask[r, start : start + n] = item["loss_mask"]
            position_ids[r, start : start + n] = torch.arange(n)
            document_ids[r, start : start + n] = doc
            segments.append((r, start, int(item["index"])))
            start += n
        position_ids[r, start:] = torch.arange(width - start)
        document_ids[r, start:] = len(row)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "attention_mask": torch.arange(width)[None, :] < lengths[:, None],
        "position_ids": position_ids,
        "document_ids": document_ids,
        "lengths": lengths,
        "indices": torch.tensor([index for _, _, index in segments], dtype=torch.long),
        "segments": torch.tensor(segments, dtype=torch.long),
    }


def _order_for_rank(batches: list, generator: torch.Generator | None, rank: int, world_size: int) -> list:
    """Both samplers' last step: shuffle the batch order (unless `generator` is None), then give this
    rank every world_size-th batch (the tail that does not divide evenly is dropped so all ranks step
    together)."""
    if generator is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    if world_size > 1:
        usable = len(batches) - len(batches) % world_size
        batches = batches[rank:usable:world_size]
    return batches


class LengthBucketBatchSampler:
    """Batches of similar-length sequences; the order is a pure function of (seed, epoch).

    Each epoch: shuffle all indices, cut them into pools of `pool_batches` batches' worth, sort each
    pool by length, form batches (at most `batch_size` sequences and/or at most `max_tokens` padded
    tokens = rows x longest row), then shuffle the batch order. With `world_size` > 1 every rank
    takes every `world_size`-th batch (the tail that does not divide evenly is dropped so all ranks
    step together).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        pool_batches: int = 64,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if max_tokens is None and batch_size is None:
            raise ValueError("set max_tokens, batch_size or both")
        if max_tokens is not None and max_tokens < max(lengths):
            raise ValueError(f"max_tokens={max_tokens} is smaller than the longest sequence ({max(lengths)})")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.lengths = list(lengths)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.pool_batches = pool_batches
        self.rank = rank
        self.world_size = world_size
        self._cache: tuple[int, list[list[int]]] | None = None

    def _fits(self, count: int, longest: int) -> bool:
        if self.batch_size is not None and count > self.batch_size:
            return False
        return self.max_tokens is None or count * longest <= self.max_tokens

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of `epoch` (dataset indices)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        n = len(self.lengths)
        order = torch.randperm(n, generator=generator).tolist() if self.shuffle else list(range(n))
        if self.batch_size is not None:
            pool = self.batch_size * self.pool_batches
        else:
            mean = max(1, sum(self.lengths) // n)
            pool = max(1, (self.max_tokens or mean) // mean) * self.pool_batches
        batches: list[list[int]] = []
        for start in range(0, n, pool):
            chunk = sorted(order[start : start + pool], key=lambda i: (self.lengths[i], i))
            current: list[int] = []
            for index in chunk:
                if current and not self._fits(len(current) + 1, self.lengths[index]):
                    batches.append(current)
                    current = []
                current.append(index)
            if current:
                batches.append(current)
        batches = _order_for_rank(batches, generator if self.shuffle else None, self.rank, self.world_size)
        self._cache = (epoch, batches)
        return batches

    def __len__(self) -> int:
        return len(self.batches(0))


class PackedBatchSampler:
    """Rows packed with whole sequences up to `row_tokens` real tokens, `max_tokens // row_tokens`
    rows per batch; the order is a pure function of (seed, epoch).

    Each epoch: shuffle all indices, cut them into pools of `pool_rows` rows' worth of tokens, pack
    each pool first-fit-decreasing (long sequences first, each into the first row with room), group
    consecutive rows into batches, then shuffle the batch order. A batch is a list of rows, a row a
    list of dataset indices (`collate_packed`). Ranks split batches as in `LengthBucketBatchSampler`.
    Compared with padding length buckets, nearly every token of a row is real; the price is attention
    over the whole row (measured on SmolLM2: one 2,048-token row costs ~1.2x two 1,024-token rows),
    so rows as long as the longest sequence are the usual choice.
    """

    packed = True

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        row_tokens: int,
        max_tokens: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        pool_rows: int = 64,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if row_tokens < max(lengths):
            raise ValueError(f"row_tokens={row_tokens} is smaller than the longest sequence ({max(lengths)})")
        max_tokens = row_tokens if max_tokens is None else max_tokens
        if max_tokens < row_tokens:
            raise ValueError(f"max_tokens={max_tokens} must hold at least one row of row_tokens={row_tokens}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.lengths = list(lengths)
        self.row_tokens = row_tokens
        self.rows_per_batch = max_tokens // row_tokens
        self.seed = seed
        self.shuffle = shuffle
        self.pool_rows = pool_rows
        self.rank = rank
        self.world_size = world_size
        self._cache: tuple[int, list[list[list[int]]]] | None = None

    def _pack(self, indices: list[int]) -> list[list[int]]:
        rows: list[list[int]] = []
        room: list[int] = []
        for index in sorted(indices, key=lambda i: (-self.lengths[i], i)):
            n = self.lengths[index]
            slot = next((r for r, free in enumerate(room) if free >= n), None)
            if slot is None:
                rows.append([])
                room.append(self.row_tokens)
                slot = len(rows) - 1
            rows[slot].append(index)
            room[slot] -= n
        return rows

    def batches(self, epoch: int) -> list[list[list[int]]]:
        """This rank's batches of `epoch`: lists of rows of dataset indices."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        n = len(self.lengths)
        order = torch.randperm(n, generator=generator).tolist() if self.shuffle else list(range(n))
        budget = self.pool_rows * self.row_tokens
        rows: list[list[int]] = []
        pool: list[int] = []
        tokens = 0
        for index in order + [-1]:  # -1 flushes the last pool
            if index < 0 or tokens + self.lengths[index] > budget:
                rows.extend(self._pack(pool))
                pool, tokens = [], 0
            if index >= 0:
                pool.append(index)
                tokens += self.lengths[index]
        batches = [rows[i : i + self.rows_per_batch] for i in range(0, len(rows), self.rows_per_batch)]
        batches = _order_for_rank(batches, generator if self.shuffle else None, self.rank, self.world_size)
        self._cache = (epoch, batches)
        return batches

    def __len__(self) -> int:
        return len(self.batches(0))


class ResumableLoader:
    """Iterates collated batches epoch after epoch and can resume at the exact batch.

    One `for batch in loader` loop runs the rest of the current epoch; the next loop runs the next
    epoch. `state_dict()` counts batches *handed out* (no prefetching), so saving it after a step and
    loading it into a fresh loader continues with the very next batch.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_sampler: LengthBucketBatchSampler | PackedBatchSampler,
        *,
        pad_token_id: int = 0,
    ) -> None:
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.pad_token_id = pad_token_id
        self.epoch = 0
        self.position = 0  # batches of `epoch` already handed out

    def __len__(self) -> int:
        return len(self.batch_sampler.batches(self.epoch))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = self.batch_sampler.batches(self.epoch)
        while self.position < len(batches):
            batch = batches[self.position]
            self.position += 1
            if getattr(self.batch_sampler, "packed", False):
                # Full-width rows: every batch has the same shape (compiled targets never recompile).
                rows = [[self.dataset[i] for i in row] for row in batch]
                yield collate_packed(rows, self.pad_token_id, width=self.batch_sampler.row_tokens)
            else:
                yield collate([self.dataset[i] for i in batch], self.pad_token_id)
        self.epoch += 1
        self.position = 0

    def skip(self, batches: int) -> None:
        """Move past `batches` batches of the order without loading them (across epochs).

        For a run that continues a head another run trained on the same data, seed and batching:
        skipping that run's batches makes this one start on data the head has not seen.
        """
        if batches < 0:
            raise ValueError(f"cannot skip a negative number of batches ({batches})")
        remaining = batches
        while remaining:
            epoch_length = len(self.batch_sampler.batches(self.epoch))
            if epoch_length <= self.position:
                raise ValueError("the loader has no batches to skip: empty dataset")
            step = min(remaining, epoch_length - self.position)
            self.position += step
            remaining -= step
            if self.position == epoch_length:
                self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.batch_sampler.seed,
            "num_sequences": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["seed"]) != self.batch_sampler.seed or int(state["num_sequences"]) != len(self.dataset):
            raise ValueError(
                f"data state does not match this loader: saved seed={state['seed']} / "
                f"{state['num_sequences']} sequences, now seed={self.batch_sampler.seed} / {len(self.dataset)}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
