"""dart-eval's `compile` setting: `auto` (the default) compiles the decoding steps where that is the faster
loop (`compile_pays`: CPUs, full-attention targets), true/false choose, anything else is refused in one
line before a model loads; the records keep what ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_llama_config
from hydra import compose, initialize_config_dir

from dart_infer.cli.eval_checks import resolve_compile
from dart_infer.common.configs import configs_dir
from dart_infer.common.errors import InputError
from dart_infer.decoding.compile import compile_pays


def eval_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        return compose("eval", overrides=list(overrides))


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    """config.json of a full-attention target and of one with a sliding window (all the rule reads)."""
    root = tmp_path_factory.mktemp("targets")
    for name, config in (("full", tiny_llama_config()), ("sliding", tiny_llama_config(sliding_window=16))):
        config.save_pretrained(root / name)
    return {name: root / name for name in ("full", "sliding")}


def test_compile_pays_on_cpus_for_full_attention_targets() -> None:
    assert compile_pays(tiny_llama_config(), "cpu") is True
    assert compile_pays(tiny_llama_config(), torch.device("cpu")) is True
    assert compile_pays(tiny_llama_config(sliding_window=16), "cpu") is False  # CompiledTarget refuses it
    assert compile_pays(tiny_llama_config(), "cuda") is False  # not measured on GPUs


def test_eval_defaults_to_auto() -> None:
    assert eval_cfg().compile == "auto"


@pytest.mark.parametrize(("target", "setting", "compiled"), [
    ("full", "auto", True),
    ("sliding", "auto", False),
    ("full", "false", False),
    ("sliding", "true", True),  # an explicit choice is kept (CompiledTarget then says why it cannot)
])
def test_resolve_compile(targets, capsys, target: str, setting: str, compiled: bool) -> None:
    cfg = eval_cfg("model=custom", f"model.name_or_path={targets[target]}", f"compile={setting}")
    assert resolve_compile(cfg) is compiled
    assert cfg.compile is compiled  # written back: the records and the fit store what ran
    said = capsys.readouterr().out
    assert ("compile=auto: " + ("compiled" if compiled else "eager")) in said if setting == "auto" else not said


def test_a_bad_compile_value_is_refused_in_one_line(targets) -> None:
    cfg = eval_cfg("model=custom", f"model.name_or_path={targets['full']}")
    cfg.compile = "yes"  # past the command line's check: programmatic configs (dart-demo's) meet this one
    with pytest.raises(InputError, match=r"compile=yes: use true, false or auto"):
        resolve_compile(cfg)


def test_compile_does_not_pay_with_bf16_weights() -> None:
    assert compile_pays(tiny_llama_config(), "cpu", bf16_weights=True) is False


def test_bf16_weights_need_float32_serving(tmp_path: Path) -> None:
    from dart_infer.cli.eval_checks import check_eval_inputs

    cfg = eval_cfg("model.dtype=bfloat16", "bf16_weights=true", f"out_dir={tmp_path / 'out'}")
    with pytest.raises(InputError, match=r"bf16_weights=true is for float32 serving on a CPU"):
        check_eval_inputs(cfg)
