"""Model dtypes: names, whether bfloat16 is faster here (measured), and casting a model the way
transformers' loaders do. Used by serving (`DartModel`, `dart-eval`) and by training (`dart-train`'s
bf16 copy of the target), so both cast the same way."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["as_dtype", "cast_parameters", "dtype_name", "bf16_is_faster", "resolve_dtype", "resolve_dtype_name"]

DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch floating dtype from itself or a name ("float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16")."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        name = str(dtype).removeprefix("torch.").lower()
        if name not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_NAMES)}")
        resolved = DTYPE_NAMES[name]
    if not resolved.is_floating_point:
        raise ValueError(f"a model dtype must be floating point, got {resolved}")
    return resolved


def bf16_is_faster(device: torch.device | str = "cpu") -> bool:
    """Whether `device` decodes faster in bfloat16 than in float32: a CUDA GPU with bf16; a CPU where
    bf16 matmuls measured clearly faster (`dart_infer.common.machine`: once per CPU, then cached;
    AVX-512 CPUs without AVX512-BF16/AMX convert in software and are often slower in bf16)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        from dart_infer.common.machine import cpu_bf16_pays

        return cpu_bf16_pays()
    return False


def default_device() -> torch.device:
    """Where the commands run models: the GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dtype_name(dtype: torch.dtype) -> str:
    """"float32", "bfloat16", ... (the name configs use)."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(value: str | torch.dtype | None, otherwise: torch.dtype | None = torch.float32) -> torch.dtype | None:
    """The one resolver of a dtype setting, for serving and training alike: null/none gives None, a
    name (float32, bf16, ...) its dtype, and `auto` bfloat16 where it measures faster on this machine
    (CUDA; a CPU measured once, `bf16_is_faster`), else `otherwise` (float32, the exactness mode, for a serving
    dtype; None = no autocast; the model's own dtype for training's bf16 target copy)."""
    if value is None or str(value).lower() in ("null", "none", ""):
        return None
    if str(value) != "auto":
        return as_dtype(value)
    return torch.bfloat16 if bf16_is_faster(default_device()) else otherwise


def resolve_dtype_name(value: str) -> str:
    """A serving dtype setting (`serve_dtype`, `model.dtype`) resolved (`resolve_dtype`: auto = bf16
    where it measures faster, else float32) to its canonical name."""
    dtype = resolve_dtype(value)
    if dtype is None:
        raise ValueError(f"unknown dtype {value!r}; use auto or one of {sorted(DTYPE_NAMES)}")
    return dtype_name(dtype)


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast `module`'s floating parameters to `dtype` in place, buffers untouched; returns `module`.

    What transformers' loaders do for a model loaded in bf16: the rotary `inv_freq` buffers stay
    float32. `.to(torch.bfloat16)` would round them too, and rotations then drift with the position
    (SmolLM2's head dims: cos off by up to 0.33 at position 300 and 1.7 at 1,500), which costs the
    draft head its acceptance on long prompts.
    """
    for parameter in module.parameters():
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    return module
