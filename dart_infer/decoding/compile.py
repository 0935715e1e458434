"""`compile_decoding`: a `DartModel` whose target (and DART draft step) run as frozen, fixed-shape
compiled graphs (`dart_infer.target.compiled`, `dart_infer.methods.dart.compiled_draft`).

Compiling takes minutes on a 2-core CPU (`scripts/bench_first_token.py`), so `background=True` keeps
decoding eagerly while a low-priority thread compiles, then swaps the compiled steps in: a request
takes the target and draft step it finds when it starts, so one in flight finishes on the eager ones."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import torch

from dart_infer.target.compiled import CompiledTarget, compilable

__all__ = ["BackgroundCompile", "compile_decoding", "compile_pays"]

log = logging.getLogger(__name__)

# The compiling thread runs at the lowest CPU priority, so the requests served meanwhile keep the cores
# (measured, AVX-512 EPYC, bf16: eager DART 26.6-28.3 tokens/s beside it, 33.5 alone, 2-5 at equal
# priority; compiling took 113 s at equal priority, 112-117 s at the lowest).
_COMPILER_NICE = 19


def compile_pays(config: Any, device: torch.device | str, *, bf16_weights: bool = False) -> bool:
    """Whether `compile_decoding` makes the faster loop for a target with this (transformers) config on
    `device`: on CPUs, wherever the target can be compiled (full attention), in either dtype. Measured on
    each CPU class we had (2 cores, SmolLM2 + the shipped head, greedy): with AVX2 kernels (fp32) eager
    DART made 17.7 tokens/s, 0.84x our eager plain decoding, compiled 52.1 (`make demo`, 8 x 128); on
    the AVX-512 EPYC (bf16) eager 33.5 (`scripts/bench_first_token.py --mode eager`), compiled 97.9 on
    MT-Bench (20 x 256); on the AMX Xeon the compiled loop made the 2.16x vLLM plain of the README.
    GPUs: not measured here, so not compiled by default. With bf16 weights (`dart_infer.target.bf16_weights`)
    the eager steps are as fast (AVX2 kernels, 300 cached tokens: eager AR 21.6 ms, 5-node verification
    23.9; compiled 18.9 and 25.6), so the minutes of compiling buy nothing there."""
    return torch.device(device).type == "cpu" and compilable(config) and not bf16_weights


class BackgroundCompile:
    """The compiling thread of `compile_decoding(..., background=True)`, as `model.compiling`:
    `done`, `wait(timeout)`, and `error` (decoding stays eager if compiling failed)."""

    def __init__(self, build: Any) -> None:
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, args=(build,), name="dart-compile", daemon=True)
        self._thread.start()

    def _run(self, build: Any) -> None:
        start = time.perf_counter()
        if sys.platform == "linux":  # a Linux thread has its own nice value, and the compiler's g++ inherit it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILER_NICE)
        try:
            build()
        except Exception as error:  # noqa: BLE001 - serving goes on eagerly; the error is kept and logged
            self.error = error
            log.warning("compiling the decoding steps failed, decoding stays eager: %s", error)
        else:
            self.seconds = time.perf_counter() - start
            log.info("compiled decoding steps in %.0f s: requests from now on run compiled", self.seconds)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until compiled (or failed), at most `timeout` seconds; whether it has finished."""
        self._thread.join(timeout)
        return self.done


def compile_decoding(
    model: Any,
    *,
    tree_sizes: tuple[int, ...] | None = None,
    capacity: int = 1024,
    plain: bool | None = None,
    background: bool = False,
) -> Any:
    """`model` (a `DartModel`) decoding through a `CompiledTarget` from now on, for its AR baseline and
    its tree decoding alike, and a DART head's draft step through `CompiledDraftStep`. `tree_sizes`
    default: its tree settings' usual tree (the tree-size setting's nodes + root) and its largest one
    (`DraftMethod.max_tree_nodes`). Compiles those shapes before it returns (`compile_now`), and the
    plain one-token step only with `plain=True` (default: only when the model has no head): each
    target graph takes about a minute here (SmolLM2-135M, 2 cores), and serving a head never runs
    the plain step. Without it, `ar_generate` compiles that step on its first call.

    `background=True` returns at once: the model decodes eagerly until a thread has compiled, then
    compiled (`model.compiling`, a `BackgroundCompile`, says when). The first token comes in seconds,
    and requests made meanwhile decode at ~85% of the eager speed (bf16 SmolLM2 on a 2-core EPYC:
    28.3 tokens/s, compiled 112 s after the start; `scripts/bench_first_token.py --mode background`).
    Returns `model`."""
    settings = model.tree  # resolved here, before any thread: tree="auto" fits it now, on the eager target
    if tree_sizes is None:
        tree_sizes = tuple(model.method.padded_tree_sizes(settings)) if model.method is not None else (1,)
    build_plain = model.method is None if plain is None else plain

    # Built here, so what cannot be compiled (a sliding-window target, bad sizes) fails now, in one line,
    # background or not; only the compiling itself goes to the thread.
    eager = model.target
    compiled = CompiledTarget(model.base_model, eager.aux_layer_ids, tree_sizes=tree_sizes, capacity=capacity)
    compiled.embedding_weight = eager.embedding_weight
    draft_step = None
    if model.method is not None and model.method.name == "dart":
        from dart_infer.methods.dart.compiled_draft import CompiledDraftStep

        # A step adds 1 + accepted positions: up to the draft's depth, or a copy span's.
        deepest = max(model.method.max_depth(model.draft_model, settings), int(settings.copy_span_tokens))
        draft_step = CompiledDraftStep(model.draft_model, max_new=1 + deepest, capacity=capacity)

    def build() -> None:
        compiled.compile_now(plain=build_plain, trees=model.method is not None)
        if draft_step is not None:
            draft_step.compile_now()
            # Installed next to the target, between two attribute reads of a starting request at worst:
            # either mix works (the draft step only takes the target's hidden states).
            model.compiled_draft = draft_step
        model.target = compiled  # a request keeps the target it took when it started

    if background:
        model.compiling = BackgroundCompile(build)
    else:
        build()
    return model
