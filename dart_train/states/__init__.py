"""The target's hidden states and logits that training distils: `StateSource` and the shared target
pass (`source`), computed per batch (`online`), or precomputed into a sharded, checksummed cache
(`cache` its layout, `cache_writer`, `cache_reader`). The common names are re-exported here.

May import: `dart_train.common`, `dart_train.data`, `dart_infer`.
"""

from dart_train.states.cache import CACHE_FORMAT, MANIFEST, StateCacheError, cache_bytes_per_token
from dart_train.states.cache_reader import OfflineStateSource
from dart_train.states.cache_writer import precompute_states, target_fingerprint
from dart_train.states.online import OnlineStateSource
from dart_train.states.source import STATE_KEYS, StateSource, label_positions, topk_logprobs

__all__ = [
    "CACHE_FORMAT",
    "MANIFEST",
    "STATE_KEYS",
    "OfflineStateSource",
    "OnlineStateSource",
    "StateCacheError",
    "StateSource",
    "cache_bytes_per_token",
    "label_positions",
    "precompute_states",
    "target_fingerprint",
    "topk_logprobs",
]
