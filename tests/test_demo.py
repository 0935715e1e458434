"""`dart-demo`'s evaluation stage fitted to the machine (`dart_train.demo.machine_overrides`): compiled
steps where DART is served in float32 on a CPU, no bfloat16 baselines where the CPU has no bf16 kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def eval_stage(*overrides: str):
    """The demo's eval-stage config, composed as `dart-demo <overrides>` composes it (`compile: auto` reads
    the model's config: the tests that reach it ask for the model's fixture)."""
    from hydra import compose, initialize_config_dir

    from dart_infer.common.configs import configs_dir
    from dart_train.demo import eval_config

    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        demo = compose(config_name="demo", overrides=["out_dir=/tmp/demo", *overrides])
        return eval_config(demo, "dart-smollm2-135m-instruct", Path("trie.ngt"))


@pytest.mark.parametrize(("overrides", "compiled"), [
    (["serve_dtype=float32"], True),  # auto: float32 on a CPU
    (["serve_dtype=bfloat16"], False),
    (["serve_dtype=float32", "compile=false"], False),
    (["serve_dtype=bfloat16", "compile=true"], True),
])
def test_compile_auto_compiles_float32_serving_on_a_cpu(smollm2_dir: str, overrides: list[str], compiled: bool) -> None:
    stage = eval_stage(*overrides)
    assert stage.compile is compiled and stage.model.dtype == overrides[0].split("=")[1]


def test_compile_auto_leaves_a_sliding_window_target_eager(tmp_path: Path) -> None:
    """A target with sliding-window layers (Gemma 3's kind; the rule reads only its config.json, so a tiny
    one stands in and the suite does not wait on Gemma 3's conversion for it)."""
    from helpers import tiny_llama_config

    tiny_llama_config(sliding_window=16).save_pretrained(tmp_path / "sliding")
    stage = eval_stage("model=custom", f"model.name_or_path={tmp_path / 'sliding'}", "serve_dtype=float32")
    assert stage.compile is False and stage.model.dtype == "float32"


def test_bfloat16_baselines_only_where_the_cpu_has_bf16_kernels(smollm2_dir: str, monkeypatch) -> None:
    from dart_infer.common.machine import cpu_has_bf16_kernels

    if cpu_has_bf16_kernels():
        assert list(eval_stage("serve_dtype=float32").baseline_dtypes) == ["float32", "bfloat16"]
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)  # an AVX2-only CPU
    assert list(eval_stage("serve_dtype=float32").baseline_dtypes) == ["float32"]


def test_serve_dtype_auto_on_an_avx2_cpu_serves_bf16_weights_eagerly(smollm2_dir: str, monkeypatch) -> None:
    """No bf16 arithmetic: auto picks float32 with bf16 weights, whose eager steps need no compiling."""
    from dart_infer.common.machine import cpu_bf16_pays

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)  # an AVX2-only CPU
    cpu_bf16_pays.cache_clear()  # kept per process: another test may have answered for this CPU
    try:
        stage = eval_stage("serve_dtype=auto")
        assert stage.model.dtype == "float32" and stage.bf16_weights is True and stage.compile is False
        explicit = eval_stage("serve_dtype=float32")  # the exactness mode stays plain float32, compiled
        assert explicit.bf16_weights is False and explicit.compile is True
    finally:
        cpu_bf16_pays.cache_clear()  # later tests answer for the real CPU again
