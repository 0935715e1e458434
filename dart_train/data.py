"""Re-exports only: rendering/loss mask in `dart_train.template`, the dataset and its cache in `dart_train.dataset`, batches in `dart_train.batching`, the draft vocabulary in `dart_train.vocab`."""

from dart_train.batching import (
    LengthBucketBatchSampler,
    PackedBatchSampler,
    ResumableLoader,
    collate,
    collate_packed,
)
from dart_train.dataset import DATASET_CACHE_FORMAT, DatasetStats, TokenizedDataset, build_dataset
from dart_train.template import (
    ChatTemplateError,
    TemplateStats,
    check_chat_template,
    render_segments,
    tokenize_conversation,
)
from dart_train.vocab import build_vocab_mapping

__all__ = [
    "DATASET_CACHE_FORMAT",
    "ChatTemplateError",
    "DatasetStats",
    "LengthBucketBatchSampler",
    "PackedBatchSampler",
    "ResumableLoader",
    "TemplateStats",
    "TokenizedDataset",
    "build_dataset",
    "build_vocab_mapping",
    "check_chat_template",
    "collate",
    "collate_packed",
    "render_segments",
    "tokenize_conversation",
]
