"""The target side of DART through transformers' own modeling code (no copied modeling files).

Works with any decoder-only causal LM whose forward accepts a 4D attention mask, explicit position
ids and a `DynamicCache` (Llama, Qwen2, Qwen3, Mistral, ...):

- `states`: aux hidden states (inputs of layers 2, L//2, L-3, concatenated) + logits, for training
  (online mode, offline cache) and for evaluation;
- `prefill` / `verify` / `keep_path`: the decoding loop's target calls. A draft tree is verified in
  ONE forward: its tokens attend to the whole cached prefix plus their own ancestors (a 4D mask
  [1,1,n_tree,past+n_tree]) at positions past + depth. Afterwards the cache keeps exactly the
  accepted path's K/V (gather + truncate, nothing recomputed).

Fixed costs of a decoding step (the same for DART and our AR baseline, which share this adapter):
- caches from `new_cache` append in place into spare room (`GrowingLayer`) instead of concatenating
  the whole cache on every forward;
- `keep_path` computes its index once and skips the gather when the kept nodes already lie in order;
- `use_fast_matmul_layout` stores linear weights in the layout the matmul kernel is fastest with on
  the device (column-major for float32 on CPU), for callers that own the model (`DartModel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from dart_infer.target.attention import DECODE_KERNEL, PACKED_GQA, packed_gqa
from dart_infer.target.step_cost import GrowingLayer

# Attention back-ends that accept an arbitrary additive 4D mask (and ours: PACKED_GQA, DECODE_KERNEL).
_TREE_MASK_BACKENDS = ("sdpa", "eager")


def config_sliding_window(config: Any) -> int | None:
    """The window of a target config's sliding-window layers (None: full attention everywhere)."""
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Layers whose INPUTS feed the draft head: (2, L//2, L-3) of an L-layer target.

    Index i is `hidden_states[i]` of a transformers forward (0 = embedding output), i.e. the input of
    decoder layer i.
    """
    if num_layers < 3:
        raise ValueError(f"DART needs a target with at least 3 decoder layers, got {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


class TargetModel:
    """Wraps a transformers causal LM for DART: aux hidden states, tree verification, KV keep-path.

    Decoding methods (`prefill`, `verify`, `keep_path`) handle batch size 1.
    """

    def __init__(self, model: Any, layer_ids: tuple[int, ...] | list[int] | None = None) -> None:
        self.model = model
        text = model.config.get_text_config(decoder=True)
        self.config = text
        self.num_layers = int(text.num_hidden_layers)
        self.aux_layer_ids: tuple[int, ...] = tuple(
            int(i) for i in (layer_ids if layer_ids is not None else aux_layer_ids(self.num_layers))
        )
        if len(self.aux_layer_ids) != 3 or not all(0 <= i < self.num_layers for i in self.aux_layer_ids):
            raise ValueError(
                f"aux layer ids {self.aux_layer_ids} must be 3 layer indices in [0, {self.num_layers})"
            )
        embeddings = model.get_input_embeddings()
        if embeddings is None or not hasattr(embeddings, "weight"):
            raise TypeError(f"{type(model).__name__} has no input embedding matrix")
        # Re-read after device/dtype moves (DartModel re-assigns it).
        self.embedding_weight: torch.Tensor = embeddings.weight

    # ------------------------------------------------------------------------------- properties
    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.embedding_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight.dtype

    @property
    def attn_implementation(self) -> str:
        return str(getattr(self.model.config, "_attn_implementation", None) or "eager")

    # -------------------------------------------------------------------------------- forwards
    def _forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with packed_gqa(self.model):
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                # Selecting indices keeps only the three needed layers' states alive.
                output_hidden_states=list(self.aux_layer_ids),
                logits_to_keep=logits_to_keep,
            )
        hidden = out.hidden_states
        aux = torch.cat([hidden[i] for i in self.aux_layer_ids], dim=-1)
        return aux, out.logits

    @torch.no_grad()
    def states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux_hidden [B,T,3H], logits [B,T,V]) of whole sequences (no grad, no cache).

        `attention_mask` is the usual 2D padding mask [B,T] (1 = real token), or None. Packed rows:
        `position_ids` [B,T] restarting at 0 for every packed sequence and no attention mask
        (transformers' mask builder then keeps the sequences apart).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B,T], got {tuple(input_ids.shape)}")
        if position_ids is not None:
            if attention_mask is not None:
                raise ValueError("packed rows (position_ids) take no attention_mask: positions separate them")
            position_ids = position_ids.to(self.device)
        return self._forward(input_ids.to(self.device), attention_mask=attention_mask, position_ids=position_ids)

    def new_cache(self) -> DynamicCache:
        """An empty cache for `prefill`/`next_logits`/`verify`: transformers' `DynamicCache` for this
        model, every attention layer appending in place (`GrowingLayer`).

        Sliding-window layers keep every entry too, not just the last `window - 1`: a verified tree
        overshoots the window by its own size and `keep_path` rewrites the newest entries, which a
        ring of `window - 1` slots cannot undo. The window is applied by the attention masks instead
        (transformers' own mask builder for prefill and AR steps, `tree_attention_mask` for trees),
        so each query sees exactly the keys `generate()` shows it. The cost is memory (all positions
        of every layer) and attention over the full prefix, masked, on sliding layers.
        """
        cache = DynamicCache(config=self.model.config)
        cache.layers = [
            GrowingLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
            for layer in cache.layers
        ]
        return cache

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, cache: DynamicCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, DynamicCache]:
        """Run the prompt [1,T]: (aux_hidden [1,T,3H], logits of the LAST position [V], filled cache)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"prefill takes one prompt [1,T], got {tuple(input_ids.shape)}")
        if input_ids.shape[1] == 0:
            raise ValueError("empty prompt")
        cache = cache if cache is not None else self.new_cache()
        past = cache.get_seq_length()
        positions = torch.arange(past, past + input_ids.shape[1], device=self.device)[None]
        aux, logits = self._forward(
            input_ids.to(self.device), position_ids=positions, cache=cache, logits_to_keep=1
        )
        return aux, logits[0, -1], cache

    @torch.no_grad()
    def next_logits(
        self, input_ids: torch.Tensor, cache: DynamicCache | None = None
    ) -> tuple[torch.Tensor, DynamicCache]:
        """Plain autoregressive forward of [1,T] new tokens over `cache`: (last logits [V], cache).

        No hidden states are captured: this is the baseline's step, as cheap as `generate()`'s.
        """
        cache = cache if cache is not None else self.new_cache()
        past = cache.get_seq_length()
        positions = torch.arange(past, past + input_ids.shape[1], device=self.device)[None]
        out = self.model(
            input_ids=input_ids.to(self.device),
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1], cache

    @property
    def sliding_window(self) -> int | None:
        """The window of the target's sliding-window layers (None: full attention everywhere)."""
        return config_sliding_window(self.config)

    def _layer_kinds(self) -> list[str]:
        """Per decoder layer: "full_attention" or "sliding_attention" (transformers' layer_types)."""
        kinds = getattr(self.config, "layer_types", None)
        if kinds:
            return [str(k) for k in kinds]
        # Mistral-style configs: one `sliding_window` for every layer, no layer_types.
        return ["sliding_attention" if self.sliding_window else "full_attention"] * self.num_layers

    def tree_attention_mask(
        self, tree_mask: torch.Tensor, past: int, tree_positions: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """[1,1,n,past+n] additive mask: every node sees the cached prefix and its own ancestors.

        With sliding-window layers, a dict {"full_attention": ..., "sliding_attention": ...} (the
        form transformers' hybrid models take as prepared masks): on sliding layers node i, at
        absolute position p_i = past + depth_i, sees only keys at positions > p_i - window — prefix
        entry j sits at position j (the cache holds every position in order), ancestor a at
        past + depth_a — the rule `generate()` applies to the same token on the accepted path.
        """
        n = tree_mask.shape[0]
        # Additive float masks mean the same to the eager and SDPA back-ends; the prefix is all visible.
        minimum = torch.finfo(self.dtype).min
        blocked = ~tree_mask.to(device=self.device, dtype=torch.bool)
        mask = torch.zeros(n, past + n, dtype=self.dtype, device=self.device)
        mask[:, past:].masked_fill_(blocked, minimum)
        kinds = set(self._layer_kinds())
        if "sliding_attention" not in kinds:
            return mask[None, None]
        if tree_positions is None:
            raise ValueError("a sliding-window target needs the tree's depths to mask its window")
        window = self.sliding_window
        if window is None:
            raise ValueError("the target has sliding_attention layers but no sliding_window in its config")
        depth = tree_positions.reshape(-1).to(device=self.device, dtype=torch.long)
        query = past + depth  # absolute positions of the nodes
        key = torch.cat([torch.arange(past, device=self.device), query])
        sliding = mask.masked_fill(key[None, :] <= query[:, None] - window, minimum)
        masks = {"sliding_attention": sliding[None, None]}
        if "full_attention" in kinds:
            masks["full_attention"] = mask[None, None]
        if len(kinds) == 1:
            return masks["sliding_attention"]  # every layer slides: models without layer_types take a tensor
        return masks

    @torch.no_grad()
    def verify(
        self,
        tree_tokens: torch.Tensor,
        tree_positions: torch.Tensor,
        tree_mask: torch.Tensor,
        cache: DynamicCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify a draft tree in ONE forward over `cache` (which holds everything before the root).

        tree_tokens [n] (root first), tree_positions [n] (depth of each node, root 0), tree_mask
        bool [n,n] (node i may attend to node j). Returns (aux_hidden [n,3H], logits [n,V]); the
        cache then holds past + n entries until `keep_path` is called.
        """
        if self.attn_implementation not in (*_TREE_MASK_BACKENDS, PACKED_GQA, DECODE_KERNEL):
            raise ValueError(
                f"tree verification needs an attention back-end that takes a 4D mask {_TREE_MASK_BACKENDS}; "
                f"the target uses '{self.attn_implementation}'"
            )
        tree_tokens = tree_tokens.reshape(-1)
        n = tree_tokens.numel()
        if tree_positions.numel() != n or tuple(tree_mask.shape) != (n, n):
            raise ValueError(
                f"tree shapes disagree: tokens {n}, positions {tree_positions.numel()}, mask {tuple(tree_mask.shape)}"
            )
        past = cache.get_seq_length()
        self._check_cache_keeps_everything(cache)
        positions = (tree_positions.reshape(1, -1).to(device=self.device, dtype=torch.long)) + past
        aux, logits = self._forward(
            tree_tokens.to(self.device)[None],
            attention_mask=self.tree_attention_mask(tree_mask, past, tree_positions),
            position_ids=positions,
            cache=cache,
        )
        return aux[0], logits[0]

    @staticmethod
    def _check_cache_keeps_everything(cache: DynamicCache) -> None:
        for layer in cache.layers:
            if getattr(layer, "is_sliding", False):
                raise ValueError(
                    f"tree verification needs a cache that keeps every position ({type(layer).__name__} "
                    "drops entries past its window): make it with TargetModel.new_cache()"
                )

    @staticmethod
    def keep_path(cache: DynamicCache, past: int, keep: torch.Tensor | Sequence[int]) -> None:
        """Keep the first `past` cached entries plus the tree nodes `keep` (indices into the tree, in
        order); drop every other verified node. Pure gather + truncate, no recomputation; when the
        kept nodes are 0, 1, ..., k-1 (already in place) only the truncation runs."""
        nodes = keep.tolist() if isinstance(keep, torch.Tensor) else [int(i) for i in keep]
        kept = past + len(nodes)
        in_place = nodes == list(range(len(nodes)))
        index: torch.Tensor | None = None
        for layer in cache.layers:
            if not isinstance(layer, DynamicLayer):
                raise TypeError(f"keep_path supports DynamicCache layers, got {type(layer).__name__}")
            if not layer.is_initialized:
                continue
            keys, values = layer.keys, layer.values
            if nodes and (min(nodes) < 0 or past + max(nodes) >= keys.shape[-2]):
                raise IndexError(f"keep indices out of range for a cache of {keys.shape[-2]} entries")
            if not in_place:
                if index is None or index.device != keys.device:
                    index = torch.tensor(nodes, dtype=torch.long, device=keys.device) + past
                # The right-hand side is a gathered copy, so overlapping source and target are safe.
                keys[:, :, past:kept] = keys[:, :, index]
                values[:, :, past:kept] = values[:, :, index]
            layer.keys = keys[:, :, :kept]
            layer.values = values[:, :, :kept]
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = kept
