"""Tokenized training data: the dataset the offline state cache is keyed by, and its on-disk cache.

API (used by the `dart-train` CLI and the scripts; rendering and the loss mask: `dart_train.data.template`):

- `build_dataset(conversations, tokenizer, max_length, *, template_kwargs=None, cache_dir=None)
  -> TokenizedDataset`
  (a torch `Dataset` of `{"input_ids", "loss_mask", "index"}` with `.lengths`, `.stats`,
  `.fingerprint()`); conversations without assistant turns are skipped, counted and warned about;
  an empty result raises `ValueError`.

Tokenized-data cache (`cache_dir`): one `tokenized-<key>.pt` per key of everything the result depends
on (tokenizer, chat template, options, conversations), written atomically; a damaged file is rebuilt,
never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dart_infer.common.files import atomic_path
from dart_train.data.template import TemplateStats, _messages_of, check_chat_template, tokenize_conversation

log = logging.getLogger(__name__)


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
    from dart_infer.data.assets import tokenizer_fingerprint

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
