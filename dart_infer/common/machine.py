"""What this CPU computes fastest, measured once and cached per CPU fingerprint.

oneDNN reports bfloat16 support on every AVX-512 CPU (it converts in software where the CPU has no
AVX512-BF16 or AMX instructions), and even where bf16 is native a matmul's speed depends on the
kernels a CPU gets. So `dtype=auto` does not read flags: it times the same batch-1 decoding matmuls
in float32 and bfloat16 (~1 s, both interleaved), keeps the result in
`<cache>/machine/<fingerprint>.json` (model name, the SIMD flags that choose kernels, cores, torch
threads and version), and picks bfloat16 only where it is clearly faster (`BF16_MUST_BEAT`).
`DART_CACHE_DIR` moves the cache; deleting the file measures again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from dart_infer.common.files import atomic_write_bytes

__all__ = ["BF16_MUST_BEAT", "cpu_bf16_pays", "cpu_fingerprint", "cpu_has_bf16_kernels", "machine_cache_dir", "machine_cache_file", "measure_bf16"]

log = logging.getLogger(__name__)

# The flags that decide which matmul kernels oneDNN and inductor use.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                "amx_tile", "amx_bf16", "amx_int8")
# Environment settings that cap the instruction sets kernels use (ATen + inductor, oneDNN, MKL).
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "DART_EMULATED_ISA")
# bf16 must take at most this share of fp32's time: bf16 serving is not exact (every method's output
# depends on how many tokens a forward processes), so a small gain does not pay for it.
BF16_MUST_BEAT = 0.85
FORMAT = 1


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: the model name and torch's own view are what there is
        pass
    return model, flags


def cpu_fingerprint() -> dict[str, Any]:
    """What a measurement holds for: CPU model, kernel-relevant flags, cores, torch threads and version."""
    model, flags = _cpuinfo()
    fingerprint = {
        "cpu": model,
        "flags": [f for f in KERNEL_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    # Kernels capped below what the flags offer (scripts/cpu_isa.sh, or a user's own setting) are
    # another machine as far as the measurements go.
    caps = {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)}
    if caps:
        fingerprint["isa_caps"] = caps
    return fingerprint


def machine_cache_dir() -> Path:
    """Where measurements of this machine are kept (`<cache>/machine`; `DART_CACHE_DIR` moves the cache)."""
    return Path(os.environ.get("DART_CACHE_DIR") or Path.home() / ".cache" / "dart").expanduser() / "machine"


def machine_cache_file(fingerprint: dict[str, Any] | None = None) -> Path:
    fingerprint = fingerprint or cpu_fingerprint()
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    return machine_cache_dir() / f"{key}.json"


def measure_bf16(hidden: int = 576, intermediate: int = 1536, layers: int = 30, repeats: int = 7) -> dict[str, float]:
    """Median seconds of one pass over `layers` MLP-shaped weight pairs in float32 and bfloat16, for one
    row (a plain decoding step) and 24 rows (a tree verification), the dtypes interleaved. The default
    shapes are SmolLM2-135M's MLP (~160 MB of fp32 weights: more than a CPU cache holds, so the pass
    reads memory as a decoding step does)."""
    generator = torch.Generator().manual_seed(0)
    weights = {
        dtype: [(torch.randn(intermediate, hidden, generator=generator).to(dtype),
                 torch.randn(hidden, intermediate, generator=generator).to(dtype)) for _ in range(layers)]
        for dtype in (torch.float32, torch.bfloat16)
    }
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for rows in (1, 24):
                for dtype, pairs in weights.items():
                    x = torch.randn(rows, hidden, generator=generator).to(dtype)
                    start = time.perf_counter()
                    for up, down in pairs:
                        x = torch.nn.functional.linear(torch.nn.functional.linear(x, up), down) * 1e-2
                    if repeat:  # the first pass warms the kernels up
                        times.setdefault(f"{str(dtype).removeprefix('torch.')}_rows{rows}", []).append(
                            time.perf_counter() - start)
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def _read(path: Path, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or saved.get("fingerprint") != fingerprint:
        return None
    return saved if isinstance(saved.get("bf16_share"), int | float) else None


def cpu_has_bf16_kernels() -> bool:
    """Whether this CPU has oneDNN's bfloat16 kernels (AVX-512 and up); AVX2-only CPUs run bf16 matmuls
    through slow fallbacks. The AVX-512 check makes `scripts/cpu_isa.sh avx2` answer as those CPUs do."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and torch.cpu._is_avx512_supported())


@functools.cache
def cpu_bf16_pays() -> bool:
    """Whether bfloat16 decoding steps are clearly faster than float32 on this CPU (measured once per
    fingerprint, then read from the cache file)."""
    if not cpu_has_bf16_kernels():
        return False  # no bf16 kernels at all (AVX2-only CPUs): nothing to measure
    fingerprint = cpu_fingerprint()
    path = machine_cache_file(fingerprint)
    saved = _read(path, fingerprint)
    if saved is None:
        times = measure_bf16()
        share = sum(v for k, v in times.items() if k.startswith("bfloat16")) / sum(
            v for k, v in times.items() if k.startswith("float32"))
        saved = {"format": FORMAT, "fingerprint": fingerprint, "seconds": times, "bf16_share": share,
                 "bf16": share <= BF16_MUST_BEAT, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, json.dumps(saved, indent=2).encode())
        except OSError as err:  # a read-only cache: measure again next process
            log.warning("cannot save the dtype measurement to %s: %s", path, err)
        log.info("dtype auto: bf16 matmuls take %.2f of fp32's time on this CPU (%s): %s", share,
                 fingerprint["cpu"], "bfloat16" if saved["bf16"] else "float32")
    return float(saved["bf16_share"]) <= BF16_MUST_BEAT
