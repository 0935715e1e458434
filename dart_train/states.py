"""Re-exports only: `StateSource` + the shared target pass in `dart_train.state_source`, `OnlineStateSource` in `dart_train.online_states`, the offline cache's layout in `dart_train.state_cache`, its writer in `dart_train.state_cache_writer`, its reader in `dart_train.state_cache_reader`."""

from dart_train.online_states import OnlineStateSource
from dart_train.state_cache import CACHE_FORMAT, MANIFEST, StateCacheError, cache_bytes_per_token
from dart_train.state_cache_reader import OfflineStateSource
from dart_train.state_cache_writer import precompute_states, target_fingerprint
from dart_train.state_source import STATE_KEYS, StateSource, label_positions, topk_logprobs

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
