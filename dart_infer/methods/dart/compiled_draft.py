"""DART's draft step as one compiled fixed-shape graph (the draft side of `compiled_target`).

The eager step (`DartDraftModel.draft_step`) costs ~4 ms on a 2-core Xeon for ~10 MB of layer weights
and a 19 MB lm_head: mostly per-op dispatch, as the target's eager step was. Here the same module
methods (`prefix_inputs`, `mask_inputs`, `decode`) run inside `torch.compile(fullgraph)` with fixed
shapes:
- the new prefix positions are padded to `max_new` rows (a step adds 1 + accepted positions; more,
  e.g. the prompt, run eagerly into the same cache);
- the draft layer's K/V live in one buffer per request; a step writes its rows at explicit slots
  (real positions first, then the masks, then padding, which only sees itself) and attends over a
  window of the buffer (a view whose length is symbolic in the graph, as in `compiled_target`).
Only the proposals change (never the output: verification decides every token).
"""

from __future__ import annotations

from typing import Any

import torch

from dart_infer.methods.draft_head import DraftKVCache
from dart_infer.target.compiled import gemm_options, inductor_settings, window_length

__all__ = ["CompiledDraftStep", "StaticDraftCache"]


class StaticDraftCache(DraftKVCache):
    """`DraftKVCache` over buffers that keep their size (so compiled steps see fixed strides); with
    `slots` set, `extend` writes a step's rows at those buffer positions and returns `window` views."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.slots: torch.Tensor | None = None
        self.window: tuple[torch.Tensor, torch.Tensor] | None = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slots is None:  # eager: append after the committed prefix
            self.make_room(self.length + keys.shape[-2], keys, values)
            return super().extend(keys, values)
        assert self.window is not None
        window_keys, window_values = self.window
        window_keys.index_copy_(2, self.slots, keys)
        window_values.index_copy_(2, self.slots, values)
        return window_keys, window_values

    def make_room(self, needed: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Buffers (shaped like `keys`/`values`) of at least `needed` positions, contents kept; sizes
        double, so compiled steps see few distinct strides."""
        if self.keys is not None and self.keys.shape[-2] >= needed:
            return
        while self.capacity < needed:
            self.capacity *= 2
        shape = (*keys.shape[:2], self.capacity, keys.shape[-1])
        grown_k, grown_v = keys.new_zeros(shape), values.new_zeros(shape)
        if self.keys is not None and self.length:
            grown_k[:, :, : self.length] = self.keys[:, :, : self.length]
            grown_v[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = grown_k, grown_v


class CompiledDraftStep:
    """`draft_step(aux_hidden_new, next_ids_new, cache)` of a DART head through a compiled graph (same
    arguments and result as `DartDraftModel.draft_step`). `new_cache()` gives the request's cache."""

    def __init__(self, draft: Any, *, max_new: int, capacity: int = 1024) -> None:
        self.draft, self.max_new, self.capacity = draft, int(max_new), int(capacity)
        self.num_masks = int(draft.config.draft_length) - 1
        inductor_settings()
        self._step = torch.compile(self._forward, fullgraph=True, dynamic=None, options=gemm_options("tree"))

    @torch.inference_mode()
    def compile_now(self) -> None:
        """Compile the step before the first request (an eager prompt step, then one compiled step)."""
        config, weight = self.draft.config, self.draft.fc.weight
        cache = self.new_cache()
        aux = torch.zeros(1, 8, 3 * config.target_hidden_size, dtype=weight.dtype, device=weight.device)
        ids = torch.ones(1, 8, dtype=torch.long, device=weight.device)
        self(aux, ids, cache)
        self(aux[:, :1], ids[:, :1], cache)

    def new_cache(self) -> StaticDraftCache:
        return StaticDraftCache(self.capacity)

    def _forward(
        self, aux: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
        keep: torch.Tensor, cache: StaticDraftCache,
    ) -> torch.Tensor:
        draft = self.draft
        res_p, in_p = draft.prefix_inputs(aux, ids)
        res_m, in_m = draft.mask_inputs(1, self.num_masks)
        residual, attn_in = torch.cat([res_p, res_m], dim=1), torch.cat([in_p, in_m], dim=1)
        return draft.decode(residual, attn_in, positions, mask, keep=keep, kv_cache=cache)

    @torch.inference_mode()
    def __call__(self, aux_hidden_new: torch.Tensor, next_ids_new: torch.Tensor, cache: StaticDraftCache) -> torch.Tensor:
        n = aux_hidden_new.shape[1]
        if n > self.max_new or cache.keys is None:  # the prompt (or an unusually long accept): eager
            return self.draft.draft_step(aux_hidden_new, next_ids_new, cache)
        rows, past, device = self.max_new + self.num_masks, cache.length, aux_hidden_new.device
        cache.make_room(past + rows, cache.keys, cache.values)
        aux = aux_hidden_new.new_zeros(1, self.max_new, aux_hidden_new.shape[-1])
        aux[:, :n] = aux_hidden_new
        ids = torch.zeros(1, self.max_new, dtype=torch.long, device=device)
        ids[:, :n] = next_ids_new.reshape(1, -1)
        # Row order: n real positions, padding, the masks; buffer slots: real, masks, padding.
        order = torch.arange(rows, device=device)
        slots = torch.where(order < n, past + order,
                            torch.where(order >= self.max_new, past + n + order - self.max_new,
                                        past + self.num_masks + order))
        positions = torch.where(order >= self.max_new, past + n + order - self.max_new, past + order)[None]
        window = window_length(past + rows, cache.capacity)
        columns = torch.arange(window, device=device)
        # Real rows and masks see every slot up to their own (the prefix, real rows and masks before
        # them: exactly the eager step's causal mask); padding sees only its own slot.
        padding = (order >= n) & (order < self.max_new)
        visible = columns[None, :] <= torch.where(padding, -1, slots)[:, None]
        visible[order[padding], slots[padding]] = True
        keep = torch.cat([torch.tensor([n - 1], device=device), torch.arange(self.max_new, rows, device=device)])[None]
        cache.slots = slots
        cache.window = (cache.keys[:, :, :window], cache.values[:, :, :window])
        mask = visible[None, None]
        for tensor, dim in ((cache.window[0], 2), (cache.window[1], 2), (mask, 3)):
            torch._dynamo.mark_dynamic(tensor, dim)
        try:
            logits = self._step(aux, ids, positions, mask, keep, cache)
        finally:
            cache.slots, cache.window = None, None
        cache.length = past + n
        return logits[0]
