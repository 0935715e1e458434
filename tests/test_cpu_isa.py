"""scripts/cpu_isa.sh avx2: every Python process it starts sees an AVX2-only CPU, engine processes included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cpu_isa.sh"

# vLLM's engine processes ask for torch's spec (a probe, nothing executed) before importing it.
PROBE_THEN_IMPORT = """
import importlib.util
assert importlib.util.find_spec("torch") is not None
import torch
print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported())
"""


def test_torch_reports_avx2_only_even_after_a_spec_probe() -> None:
    out = subprocess.run([str(SCRIPT), "avx2", sys.executable, "-c", PROBE_THEN_IMPORT], capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False", "False"]


def test_only_avx2_is_emulated() -> None:
    out = subprocess.run([str(SCRIPT), "avx512", "true"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "only avx2 is emulated" in out.stderr
