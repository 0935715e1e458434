"""Loaded by `scripts/cpu_isa.sh` (its folder goes first on PYTHONPATH): when torch is imported, its
CPU feature checks answer as an AVX2-only CPU would (no AVX-512, AVX512-BF16, AMX), so code that
reads them (vLLM's kernel library choice) takes the AVX2 machine's path. The environment variables the script sets cap the kernels' ISA."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_FALSE_CHECKS = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported")


def _patch_torch(torch) -> None:
    for name in _FALSE_CHECKS:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)
    # torch.ops.mkldnn._is_mkldnn_bf16_supported still answers True (ops cannot be replaced from
    # Python): bf16 oneDNN kernels run, capped to AVX2 (dtype=auto measures them slow and picks fp32).


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Wraps torch's loader so the patch runs right after `import torch` finishes. It stays on
    sys.meta_path until then: a probe such as `importlib.util.find_spec("torch")` (vLLM's engine
    processes make one before importing torch) asks for a spec without executing it."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module) -> None:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            exec_module(module)
            _patch_torch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("DART_EMULATED_ISA") == "avx2":
    sys.meta_path.insert(0, _AfterTorch())
