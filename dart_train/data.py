"""Training data: chat template + loss mask, length-bucketed resumable batches, draft vocabulary.

API (used by `dart_train.states`, the training engine and the `dart-train` CLI):

- `tokenize_conversation(tokenizer, conversation, max_length, *, template_kwargs=None)
  -> list[{"input_ids": LongTensor[T], "loss_mask": BoolTensor[T]}]`
  The tokenizer's own chat template renders the conversation; `loss_mask` is True exactly on the
  tokens the assistant produced (its content and its end-of-turn token, e.g. `<|im_end|>`; never
  role headers, the generation prompt, nor the newline the template writes after the turn).
  Usually ONE sequence; several when the template rewrites history (see "Loss-mask rule").
- `build_dataset(conversations, tokenizer, max_length, *, template_kwargs=None, cache_dir=None)
  -> TokenizedDataset`
  (a torch `Dataset` of `{"input_ids", "loss_mask", "index"}` with `.lengths`, `.stats`,
  `.fingerprint()`); conversations without assistant turns are skipped, counted and warned about;
  an empty result raises `ValueError`.
- `LengthBucketBatchSampler(lengths, *, max_tokens=None, batch_size=None, seed=0, shuffle=True,
  rank=0, world_size=1)`: batches of similar lengths, deterministic per (seed, epoch).
- `ResumableLoader(dataset, batch_sampler)`: iterate batches (collated, no worker processes);
  `state_dict()` / `load_state_dict()` restore the exact position (epoch + batches consumed), so a
  resumed run sees exactly the batches an uninterrupted run would have seen next.
- `collate(items, pad_token_id=0)` → `{"input_ids" [B,T] long, "loss_mask" [B,T] bool,
  "attention_mask" [B,T] bool (True = real token), "position_ids" [B,T] long, "lengths" [B],
  "indices" [B] (dataset indices: the offline state cache is looked up by them)}`. Right padding,
  so real tokens keep positions 0..len-1 and causal attention never sees a pad.
- `build_vocab_mapping(sequences, target_vocab_size, draft_vocab_size, *, special_token_ids=())
  -> LongTensor[draft_vocab_size]`: the draft→target id map for `DartDraftModel.set_vocab_mapping`
  (which fills t2d bool[vocab] and d2t with target id = i + d2t[i]).

Loss-mask rule (works for any template, no per-model registry):
for assistant turn i, P_i = template(messages[:i], add_generation_prompt=True) and
A_i = template(messages[:i+1]); A_i must start with P_i, and the turn's trained text is
A_i[len(P_i):] without trailing whitespace. Turn i joins the current sequence when A_i starts with
that sequence's text (the history is rendered exactly as the model saw it when it produced turn i);
otherwise a new sequence A_i starts. Templates that keep history (SmolLM2, Llama 3, ChatML) give one
sequence per conversation. Qwen3-style templates drop the `<think>` block of earlier turns (and, with
`enable_thinking=False`, render the empty think block only in the generation prompt), so a later turn
rewrites history: such a conversation yields one sequence per rewritten turn, and every assistant
token is trained in the context in which the model actually generated it. Pass template options
(`{"enable_thinking": False}`) through `template_kwargs`. A turn whose generation prompt is not a
prefix of its rendering cannot be located: it is left out of the mask and counted. An assistant
turn before any user message (ShareGPT has chunks that start mid-conversation) answers nothing the
model would ever be asked: it stays as context, untrained, and is counted.

Truncation keeps the first `max_length` tokens; a sequence with no assistant token left is dropped
and counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dart_infer.files import atomic_path

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ chat template


class ChatTemplateError(ValueError):
    """The tokenizer cannot render conversations in a way the loss mask can be computed from."""


def _messages_of(conversation: Any) -> list[dict[str, str]]:
    messages = conversation.messages if hasattr(conversation, "messages") else conversation.get("messages")
    if not isinstance(messages, list):
        raise TypeError(f"expected a Conversation or a dict with 'messages', got {type(conversation).__name__}")
    return messages


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool, kwargs: Mapping) -> str:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )
    if not isinstance(text, str):  # batched input is never passed here; guard against API drift
        raise ChatTemplateError(f"apply_chat_template returned {type(text).__name__}, expected str")
    return text


def check_chat_template(tokenizer: Any) -> None:
    """Raise `ChatTemplateError` unless the tokenizer has a chat template and fast offsets."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; training data "
            "is rendered with the target's own template. Set `tokenizer.chat_template` (a Jinja string) "
            "or use the instruct/chat variant of the model."
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError("The loss mask needs a fast (Rust) tokenizer: token character offsets are used.")


@dataclass
class _Segment:
    text: str
    spans: list[tuple[int, int]] = field(default_factory=list)  # character spans of trained text


@dataclass
class TemplateStats:
    """Counters of what rendering left out (summed over a dataset)."""

    turns: int = 0
    turns_without_prompt: int = 0  # assistant speaks before any user message: nothing it answers
    unlocatable_turns: int = 0  # generation prompt is not a prefix of the rendered turn
    rewritten_histories: int = 0  # extra sequences because a later turn re-rendered the history

    def add(self, other: TemplateStats) -> None:
        self.turns += other.turns
        self.turns_without_prompt += other.turns_without_prompt
        self.unlocatable_turns += other.unlocatable_turns
        self.rewritten_histories += other.rewritten_histories


def render_segments(
    tokenizer: Any,
    conversation: Any,
    *,
    template_kwargs: Mapping | None = None,
    stats: TemplateStats | None = None,
) -> list[_Segment]:
    """Texts to train on and the character spans of assistant output in them (see module doc)."""
    check_chat_template(tokenizer)
    kwargs = dict(template_kwargs or {})
    messages = _messages_of(conversation)
    stats = stats if stats is not None else TemplateStats()
    segments: list[_Segment] = []
    current: _Segment | None = None
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        stats.turns += 1
        if not any(m.get("role") == "user" for m in messages[:i]):
            stats.turns_without_prompt += 1
            continue
        prompt = _render(tokenizer, messages[:i], True, kwargs)
        rendered = _render(tokenizer, messages[: i + 1], False, kwargs)
        if not rendered.startswith(prompt):
            stats.unlocatable_turns += 1
            continue
        body = rendered[len(prompt) :].rstrip()
        if not body:
            continue
        span = (len(prompt), len(prompt) + len(body))
        if current is not None and rendered.startswith(current.text):
            current.text = rendered
            current.spans.append(span)
        else:
            if current is not None:
                stats.rewritten_histories += 1
                segments.append(current)
            current = _Segment(rendered, [span])
    if current is not None:
        segments.append(current)
    return segments


def tokenize_conversation(
    tokenizer: Any,
    conversation: Any,
    max_length: int,
    *,
    template_kwargs: Mapping | None = None,
    stats: TemplateStats | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Token ids + assistant loss mask of a conversation; usually one sequence (see module doc).

    Sequences are truncated to `max_length` tokens; those left without any assistant token are dropped.
    An empty list means the conversation has nothing to train on (no assistant turn).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    out = []
    for segment in render_segments(tokenizer, conversation, template_kwargs=template_kwargs, stats=stats):
        encoded = tokenizer(segment.text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        offsets = encoded["offset_mapping"]
        mask = [False] * len(ids)
        span_index = 0
        spans = segment.spans
        for t, (start, end) in enumerate(offsets):
            while span_index < len(spans) and spans[span_index][1] <= start:
                span_index += 1
            if span_index == len(spans):
                break
            # A token is trained when it starts inside an assistant span (spans never split a token:
            # they end at a special end-of-turn token or at the end of the text).
            span_start, span_end = spans[span_index]
            mask[t] = span_start <= start < span_end and end > start
        input_ids = torch.tensor(ids[:max_length], dtype=torch.long)
        loss_mask = torch.tensor(mask[:max_length], dtype=torch.bool)
        if loss_mask.any():
            out.append({"input_ids": input_ids, "loss_mask": loss_mask})
    return out


# --------------------------------------------------------------------------------------------- dataset


@dataclass
class DatasetStats:
    conversations: int = 0
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    skipped_no_assistant: int = 0
    skipped_nothing_to_train: int = 0  # every assistant turn unanswerable, unlocatable or cut by max_length
    truncated: int = 0
    template: TemplateStats = field(default_factory=TemplateStats)

    def as_dict(self) -> dict[str, int]:
        out = {k: v for k, v in self.__dict__.items() if k != "template"}
        out.update({f"template_{k}": v for k, v in self.template.__dict__.items()})
        return out


class TokenizedDataset(torch.utils.data.Dataset):
    """Tokenized, loss-masked sequences in a fixed order (the order the offline cache is keyed by)."""

    def __init__(
        self,
        sequences: list[dict[str, torch.Tensor]],
        conversation_ids: list[str] | None = None,
        stats: DatasetStats | None = None,
    ) -> None:
        if not sequences:
            raise ValueError("empty dataset: no sequence with assistant tokens to train on")
        self.sequences = sequences
        self.conversation_ids = conversation_ids or [str(i) for i in range(len(sequences))]
        self.stats = stats or DatasetStats(sequences=len(sequences))
        self.lengths = [int(s["input_ids"].numel()) for s in sequences]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item = self.sequences[index]
        return {"input_ids": item["input_ids"], "loss_mask": item["loss_mask"], "index": index}

    def fingerprint(self) -> str:
        """Hash of every sequence's ids and mask, in order: ties an offline state cache to this data."""
        digest = hashlib.sha256()
        for item in self.sequences:
            digest.update(item["input_ids"].numpy().astype("<i8").tobytes())
            digest.update(item["loss_mask"].numpy().tobytes())
            digest.update(b"|")
        return digest.hexdigest()[:32]


DATASET_CACHE_FORMAT = "dart-tokenized-v1"


def _dataset_key(conversations: list[Any], tokenizer: Any, max_length: int, template_kwargs: Mapping | None) -> str:
    """Everything the tokenized result depends on: tokenizer, template, options and the conversations."""
    from dart_infer.assets import tokenizer_fingerprint

    digest = hashlib.sha256()
    header = [DATASET_CACHE_FORMAT, tokenizer_fingerprint(tokenizer), tokenizer.chat_template, max_length,
              sorted((template_kwargs or {}).items())]
    digest.update(json.dumps(header, default=str).encode())
    for conversation in conversations:
        conv_id = getattr(conversation, "id", None)
        digest.update(json.dumps([conv_id, _messages_of(conversation)], sort_keys=True).encode())
    return digest.hexdigest()[:32]


def _save_dataset(dataset: TokenizedDataset, path: Path) -> None:
    lengths = torch.tensor(dataset.lengths, dtype=torch.int64)
    payload = {
        "format": DATASET_CACHE_FORMAT,
        "input_ids": torch.cat([s["input_ids"] for s in dataset.sequences]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in dataset.sequences]),
        "lengths": lengths,
        "conversation_ids": dataset.conversation_ids,
        "stats": dataset.stats.as_dict(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def _load_dataset(path: Path) -> TokenizedDataset | None:
    try:
        payload = torch.load(path, weights_only=True)
    except Exception as error:  # a damaged cache file is rebuilt, never trusted
        log.warning("ignoring unreadable tokenized-data cache %s (%s)", path, error)
        return None
    if payload.get("format") != DATASET_CACHE_FORMAT:
        return None
    ids = payload["input_ids"].long().split(payload["lengths"].tolist())
    masks = payload["loss_mask"].split(payload["lengths"].tolist())
    stats = DatasetStats(**{k: v for k, v in payload["stats"].items() if not k.startswith("template_")})
    stats.template = TemplateStats(
        **{k.removeprefix("template_"): v for k, v in payload["stats"].items() if k.startswith("template_")}
    )
    sequences = [{"input_ids": i, "loss_mask": m} for i, m in zip(ids, masks, strict=True)]
    return TokenizedDataset(sequences, list(payload["conversation_ids"]), stats)


def build_dataset(
    conversations: Iterable[Any],
    tokenizer: Any,
    max_length: int,
    *,
    template_kwargs: Mapping | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TokenizedDataset:
    """Tokenize conversations into a `TokenizedDataset`; skips (with a warning) what has nothing to train.

    With `cache_dir`, the result is stored under a key of (tokenizer, chat template, options,
    conversations) and reused by later runs (ShareGPT takes minutes to render and tokenize).
    """
    check_chat_template(tokenizer)
    if cache_dir is not None:
        conversations = list(conversations)
        path = Path(cache_dir) / f"tokenized-{_dataset_key(conversations, tokenizer, max_length, template_kwargs)}.pt"
        if path.exists():
            cached = _load_dataset(path)
            if cached is not None:
                log.info("tokenized data: reusing %s (%d sequences)", path, len(cached))
                return cached
        dataset = build_dataset(conversations, tokenizer, max_length, template_kwargs=template_kwargs)
        _save_dataset(dataset, path)
        return dataset
    stats = DatasetStats()
    sequences: list[dict[str, torch.Tensor]] = []
    ids: list[str] = []
    for conversation in conversations:
        stats.conversations += 1
        messages = _messages_of(conversation)
        if not any(m.get("role") == "assistant" for m in messages):
            stats.skipped_no_assistant += 1
            continue
        produced = tokenize_conversation(
            tokenizer, conversation, max_length, template_kwargs=template_kwargs, stats=stats.template
        )
        if not produced:
            stats.skipped_nothing_to_train += 1
            continue
        conv_id = str(getattr(conversation, "id", None) or len(ids))
        for k, seq in enumerate(produced):
            sequences.append(seq)
            ids.append(conv_id if len(produced) == 1 else f"{conv_id}#{k}")
    stats.sequences = len(sequences)
    stats.tokens = sum(int(s["input_ids"].numel()) for s in sequences)
    stats.loss_tokens = sum(int(s["loss_mask"].sum()) for s in sequences)
    stats.truncated = sum(int(s["input_ids"].numel() == max_length) for s in sequences)
    skipped = stats.skipped_no_assistant + stats.skipped_nothing_to_train
    if skipped or stats.template.unlocatable_turns:
        message = (
            f"training data: skipped {stats.skipped_no_assistant} conversation(s) without assistant turns and "
            f"{stats.skipped_nothing_to_train} with no trainable assistant token (max_length={max_length}); "
            f"of {stats.template.turns} assistant turns, {stats.template.turns_without_prompt} come before any "
            f"user message and {stats.template.unlocatable_turns} could not be located in the chat template's "
            "rendering (not trained)"
        )
        log.warning(message)
        warnings.warn(message, stacklevel=2)
    if not sequences:
        raise ValueError(
            f"empty dataset: none of {stats.conversations} conversation(s) has assistant tokens to train on "
            f"({stats.as_dict()})"
        )
    return TokenizedDataset(sequences, ids, stats)


# ---------------------------------------------------------------------------------- batching / resume


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
        if self.shuffle:
            batch_order = torch.randperm(len(batches), generator=generator).tolist()
            batches = [batches[i] for i in batch_order]
        if self.world_size > 1:
            usable = len(batches) - len(batches) % self.world_size
            batches = batches[self.rank : usable : self.world_size]
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
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        if self.world_size > 1:
            usable = len(batches) - len(batches) % self.world_size
            batches = batches[self.rank : usable : self.world_size]
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


# ------------------------------------------------------------------------------------ draft vocabulary


def build_vocab_mapping(
    sequences: Iterable[Any],
    target_vocab_size: int,
    draft_vocab_size: int,
    *,
    special_token_ids: Sequence[int] = (),
) -> torch.Tensor:
    """The `draft_vocab_size` most frequent target tokens under the loss mask, sorted by target id.

    `sequences` yields `{"input_ids", "loss_mask"}` mappings or `(input_ids, loss_mask)` pairs.
    Equal counts are ordered special tokens first, then by smaller target id, so when fewer distinct
    tokens occur than `draft_vocab_size` the rest is filled with `special_token_ids` first, then the
    smallest unused ids. Returns LongTensor[draft_vocab_size] `draft_to_target` (draft id i → target id), the input
    of `DartDraftModel.set_vocab_mapping` (t2d/d2t, target id = i + d2t[i]).
    """
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in 1..target_vocab_size={target_vocab_size}")
    counts = torch.zeros(target_vocab_size, dtype=torch.long)
    for item in sequences:
        ids, mask = (item["input_ids"], item["loss_mask"]) if isinstance(item, Mapping) else item
        ids = torch.as_tensor(ids).reshape(-1)
        mask = torch.as_tensor(mask, dtype=torch.bool).reshape(-1)
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} differ in shape")
        chosen = ids[mask]
        if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= target_vocab_size):
            raise ValueError(f"token id outside the target vocabulary [0, {target_vocab_size})")
        counts += torch.bincount(chosen, minlength=target_vocab_size)
    # Priority: frequency (desc), then special tokens, then id (asc). A stable sort on a key keeps it exact.
    special = torch.zeros(target_vocab_size, dtype=torch.long)
    for token_id in special_token_ids:
        if token_id is not None and 0 <= int(token_id) < target_vocab_size:
            special[int(token_id)] = 1
    key = counts * 2 + special  # counts dominate; among equal counts (e.g. 0) specials come first
    order = torch.sort(-key, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values

