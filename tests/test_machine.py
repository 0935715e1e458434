"""`dtype=auto` on a CPU: bf16 and fp32 decoding matmuls timed once per CPU fingerprint, then cached
(`dart_infer.common.machine`), instead of trusting oneDNN's bf16 flag (set on every AVX-512 CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from dart_infer.common import machine
from dart_infer.common.dtypes import resolve_dtype

BF16_KERNELS = machine.cpu_has_bf16_kernels()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))
    machine.cpu_bf16_pays.cache_clear()
    yield machine.machine_cache_file()
    machine.cpu_bf16_pays.cache_clear()


def test_the_fingerprint_names_the_cpu_and_the_flags_that_choose_kernels() -> None:
    fingerprint = machine.cpu_fingerprint()
    assert fingerprint["cores"] >= 1 and fingerprint["threads"] == torch.get_num_threads()
    assert set(fingerprint["flags"]) <= set(machine.KERNEL_FLAGS)
    assert machine.machine_cache_file(fingerprint) == machine.machine_cache_file(dict(fingerprint))
    assert machine.machine_cache_file({**fingerprint, "threads": 99}) != machine.machine_cache_file(fingerprint)


def test_measuring_times_both_dtypes_at_both_row_counts() -> None:
    times = machine.measure_bf16(hidden=64, intermediate=128, layers=2, repeats=2)
    assert set(times) == {f"{d}_rows{r}" for d in ("float32", "bfloat16") for r in (1, 24)}
    assert all(t > 0 for t in times.values())


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 kernels on this CPU: auto is float32 without measuring")
@pytest.mark.parametrize(("share", "expected"), [(0.5, torch.bfloat16), (0.95, torch.float32)])
def test_auto_follows_the_cached_measurement(fresh_cache, share: float, expected: torch.dtype) -> None:
    fresh_cache.parent.mkdir(parents=True)
    fresh_cache.write_text(json.dumps({"format": machine.FORMAT, "fingerprint": machine.cpu_fingerprint(),
                                       "bf16_share": share}))
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("auto", otherwise=None) == (torch.bfloat16 if expected == torch.bfloat16 else None)


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 kernels on this CPU: auto is float32 without measuring")
def test_a_missing_or_foreign_measurement_is_measured_again_and_saved(fresh_cache) -> None:
    fresh_cache.parent.mkdir(parents=True)
    fresh_cache.write_text(json.dumps({"format": machine.FORMAT, "fingerprint": {"cpu": "another"},
                                       "bf16_share": 0.01}))
    pays = machine.cpu_bf16_pays()
    saved = json.loads(fresh_cache.read_text())
    assert saved["fingerprint"] == machine.cpu_fingerprint() and set(saved["seconds"]) == {
        f"{d}_rows{r}" for d in ("float32", "bfloat16") for r in (1, 24)}
    assert pays == (saved["bf16_share"] <= machine.BF16_MUST_BEAT) == saved["bf16"]


@pytest.mark.parametrize("missing", ["onednn_bf16", "avx512"])
def test_without_bf16_kernels_auto_is_float32_and_nothing_is_measured(fresh_cache, monkeypatch, missing) -> None:
    if missing == "onednn_bf16":
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    else:  # an AVX2-only CPU as `scripts/cpu_isa.sh avx2` presents one
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    assert not machine.cpu_has_bf16_kernels()
    monkeypatch.setattr(machine, "measure_bf16", lambda **_: pytest.fail("measured without bf16 kernels"))
    assert resolve_dtype("auto") == torch.float32 and not fresh_cache.exists()
