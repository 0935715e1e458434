"""vLLM as a baseline inside our own measurements: a vLLM engine in its own venv and process
(`dart_infer/engines/vllm/worker.py`), fed token-id prompts, so `dart-eval` can time vLLM's plain greedy
decoding interleaved with its own methods on the same prompts (`methods=[..., vllm]`).

The engine process loads once and then waits on its stdin. After a request its processes keep a core
busy for a while (`wait_idle`), so a method timed in this process right then would share the cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from dart_infer.common.errors import InputError

__all__ = ["VLLM_METHODS", "VllmRunner", "start_engines", "vllm_env_script"]

_WORKER = Path(__file__).with_name("worker.py")
# dart-eval's vLLM methods (`start_engines`): plain decoding, its prompt lookup, the DART head through
# our plugin (`dart_infer.engines.vllm.plugin`: the argmax chain, or the trie-chosen chain) and an EAGLE-3
# head through vLLM's drafter.
VLLM_METHODS = ("vllm", "vllm_ngram", "vllm_dart", "vllm_dart_trie", "vllm_eagle3")


def vllm_env_script() -> Path:
    """`scripts/vllm_env.sh` of this checkout (vLLM runs from a source checkout: `make vllm`)."""
    return Path(__file__).resolve().parents[3] / "scripts" / "vllm_env.sh"


class VllmRunner:
    """One vLLM engine for `target` (a model directory) in `dtype`, plain decoding unless a
    `speculative_config` is given. Start it before timing anything: loading (and vLLM's compiling,
    unless `enforce_eager`) takes a minute or two."""

    def __init__(self, target: str | Path, dtype: str = "bfloat16", *, speculative_config: dict[str, Any] | None = None,
                 max_model_len: int = 4096, enforce_eager: bool = False) -> None:
        script = vllm_env_script()
        venv = Path(os.environ.get("VLLM_VENV", script.parents[1] / ".venv-vllm"))
        if not script.exists() or not (venv / "bin" / "python").exists():
            raise InputError(f"the vllm method needs vLLM's venv at {venv}: run `make vllm` first "
                             "(or leave vllm out of methods)")
        command = [str(script), "python", str(_WORKER), "--target", str(target), "--dtype", dtype,
                   "--max-model-len", str(max_model_len)]
        if enforce_eager:  # vLLM's start without compiling (tests): slower steps, as a user would not run it
            command.append("--enforce-eager")
        if speculative_config:
            command += ["--speculative-config", json.dumps(speculative_config)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self._read()
        self.version = str(ready.get("vllm", "?"))
        root = psutil.Process(self.process.pid)  # the engine's processes, started by now
        self._processes = [root, *root.children(recursive=True)]

    def wait_idle(self, max_seconds: float = 3.0, window: float = 0.1, busy_share: float = 0.2) -> float:
        """Wait until the engine's processes use less than `busy_share` of a core over `window` seconds
        (at most `max_seconds`); returns the seconds waited.

        Why: after a request vLLM-CPU's worker busy-polls its shared-memory queue for 1 s
        (vllm/distributed/device_communicators/shm_broadcast.py, `busy_loop_s`) and its OpenMP threads spin
        200 ms (KMP_BLOCKTIME), a core each: measured, 35% of a core over the 2 s after a 0.3 s pause, 1%
        after 1 s; our 1,400-token prefill timed after a vLLM request plus 0.3 s took 1.86-1.95 s, without
        vLLM in the run 1.72-1.80 (AVX2 emulated, 2 cores)."""
        start = time.monotonic()
        used = self._cpu_seconds()
        while time.monotonic() - start < max_seconds:
            time.sleep(window)
            now = self._cpu_seconds()
            if now - used < busy_share * window:
                break
            used = now
        return time.monotonic() - start

    def _cpu_seconds(self) -> float:
        total = 0.0
        for process in self._processes:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"the vLLM engine exited (code {code}) before answering; its log is above")
        return json.loads(line)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 0.0,
                 top_k: int = 0, seed: int = 0) -> tuple[list[int], float, list[int] | None]:
        """vLLM's continuation of `prompt_ids` (greedy at temperature 0; top_p/top_k 0 = off), the
        seconds its `generate` took and, with a speculative config, each verification step's accepted
        draft tokens (rebuilt from vLLM's per-position counters: a chain accepts a prefix)."""
        assert self.process.stdin is not None
        request = {"prompt_ids": prompt_ids, "max_new_tokens": max_new_tokens, "temperature": temperature,
                   "top_p": top_p, "top_k": top_k, "seed": seed}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        accept_lengths = None
        if "drafts" in answer:
            per_position = [int(answer["drafts"]), *answer["accepted_per_position"], 0]
            # Steps that accepted exactly j drafts: those reaching position j minus those reaching j + 1.
            accept_lengths = [j for j in range(len(per_position) - 1)
                              for _ in range(per_position[j] - per_position[j + 1])]
        return list(answer["tokens"]), float(answer["seconds"]), accept_lengths

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def __enter__(self) -> VllmRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_engines(
    methods: list[str], target: str | Path, dtype: str, scratch: Path, *, draft_model: str | None = None,
    eagle3_model: str | None = None, ngram_tokens: int = 10, eagle3_tokens: int = 3, enforce_eager: bool = False,
    trie: str | None = None,
) -> dict[str, VllmRunner]:
    """One engine per vLLM method of dart-eval, on `target` in `dtype`:
    - `vllm`: plain decoding;
    - `vllm_ngram`: vLLM's prompt lookup (`ngram_tokens` tokens, vLLM's default n-gram sizes);
    - `vllm_dart`: the DART head `draft_model` exported into `scratch` for our plugin (the argmax chain of d);
    - `vllm_dart_trie`: the same exported with `trie` (the eval's ngram_model): the trie-chosen chain;
    - `vllm_eagle3`: the EAGLE-3 head `eagle3_model` exported for vLLM's EAGLE-3 drafter (a chain of
      `eagle3_tokens`).
    Heads are checked and exported before any engine starts; a failed start closes the others."""
    from dart_infer.engines.export import export_head

    unknown = [m for m in methods if m not in VLLM_METHODS]
    if unknown:
        raise InputError(f"methods: {unknown} are not vLLM methods ({', '.join(VLLM_METHODS)})")
    if "vllm_dart_trie" in methods and not trie:
        raise InputError("methods: 'vllm_dart_trie' needs a trie (ngram_model=<file>, or auto with the default "
                         "trie built by dart-ngram)")
    if "vllm_eagle3" in methods and not eagle3_model:
        raise InputError("methods: 'vllm_eagle3' needs eagle3_model=<an EAGLE-3 head directory>")
    configs: dict[str, dict[str, Any] | None] = {}
    for method in methods:
        if method == "vllm":
            configs[method] = None
        elif method == "vllm_ngram":
            configs[method] = {"method": "ngram", "num_speculative_tokens": ngram_tokens}
        elif method == "vllm_eagle3":
            export = export_head(str(eagle3_model), scratch / "vllm-eagle3-head", target=str(target),
                                 num_speculative_tokens=eagle3_tokens)
            if export.kind != "eagle3":
                raise InputError(f"eagle3_model={eagle3_model}: a {export.kind} head, not an EAGLE-3 one "
                                 "(dart-train draft=eagle3 trains one)")
            configs[method] = export.speculative_config
        else:
            configs[method] = export_head(str(draft_model), scratch / method, target=str(target),
                                          ngram_model=trie if method == "vllm_dart_trie" else None).speculative_config
    # vLLM refuses a context longer than the target's positions; 4096 covers every benchmark prompt.
    positions = json.loads((Path(target) / "config.json").read_text()).get("max_position_embeddings") or 4096
    engines: dict[str, VllmRunner] = {}
    try:
        for method, spec in configs.items():
            engines[method] = VllmRunner(target, dtype, speculative_config=spec, max_model_len=min(4096, positions),
                                         enforce_eager=enforce_eager)
    except BaseException:
        for engine in engines.values():
            engine.close()
        raise
    return engines
