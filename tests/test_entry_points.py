"""Every console script starts, composes its Hydra config and prints it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ENTRY_POINTS = ["dart-train", "dart-ngram", "dart-eval", "dart-demo", "dart-app"]


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"console script {name} is not installed (pip install -e .)"
    return found


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_composes_and_prints_its_config(name: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [_script(name), "--cfg", "job"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model:" in result.stdout and "name_or_path:" in result.stdout


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_unknown_config_keys_are_rejected(name: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [_script(name), "--cfg", "job", "no_such_key=1"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert result.returncode != 0
    assert "no_such_key" in result.stderr


def test_demo_evaluates_dart_in_its_serving_dtype_against_baselines_in_every_dtype(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from dart_infer.common.configs import configs_dir
    from dart_infer.common.dtypes import bf16_is_faster
    from dart_infer.common.machine import cpu_has_bf16_kernels
    from dart_train.demo import eval_config, serve_dtype

    fit = tmp_path / "fit_tree.yaml"
    fit.write_text("tree: {draft_top_k: 4, beam_width: 3, remain_total: 9, ngram_weight: 0.5}\ndtype: bfloat16\n")
    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        cfg = compose(config_name="demo", overrides=[f"out_dir={tmp_path}"])
        assert cfg.model.dtype == "float32"  # training's dtype is untouched by serve_dtype
        assert serve_dtype(cfg) == ("bfloat16" if bf16_is_faster("cpu") else "float32")
        with open_dict(cfg):
            cfg.serve_dtype = "bf16"
            cfg.eval_overrides = [*cfg.eval_overrides, f"tree={fit}"]
        (tmp_path / "head").mkdir()  # the stage's config is checked: its head must exist
        ev = eval_config(cfg, tmp_path / "head", tmp_path / "full.ngt")
    # bf16 baselines only where the CPU has bf16 kernels (test_demo.py).
    baselines = ["float32", "bfloat16"] if cpu_has_bf16_kernels() else ["float32"]
    assert ev.model.dtype == "bfloat16" and list(ev.baseline_dtypes) == baselines
    assert ev.draft_model == str(tmp_path / "head") and ev.out_dir == str(tmp_path / "eval")
    assert (ev.tree.draft_top_k, ev.tree.remain_total) == (4, 9) and ev.tree_file == str(fit.resolve())
    assert ev.limit == cfg.eval_prompts and ev.max_new_tokens == cfg.max_new_tokens


def test_demo_passes_its_hardware_to_the_training_and_evaluation_stages(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from dart_infer.common.configs import configs_dir
    from dart_train.demo import _compose, eval_config

    def demo(*overrides: str):  # as the running app sees it: HydraConfig knows the group choices
        cfg = compose(config_name="demo", overrides=[f"out_dir={tmp_path}", *overrides], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        return cfg

    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        cfg = demo("hardware=gpu")
        assert cfg.draft_model == "dart-smollm2-135m-instruct"  # the shipped head is what it serves
        train_cfg = _compose("train", cfg, list(cfg.train_overrides))
        ev = eval_config(cfg, cfg.draft_model, tmp_path / "full.ngt")
        default = demo()
        default_ev = eval_config(default, default.draft_model, tmp_path / "full.ngt")
        HydraConfig.instance().cfg = None
    assert ev.tree.remain_total == 60 and default_ev.tree.remain_total != 60  # the paper's GPU tree
    assert train_cfg.trainer.max_tokens == 2048  # the demo's own overrides still win over the group's
    assert train_cfg.trainer.max_minutes == cfg.train_minutes > 0  # the time budget of its training stage
    assert ev.draft_model == "dart-smollm2-135m-instruct"


def test_demo_trains_on_a_time_budget_checked_before_it_starts(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from dart_infer.cli.checks import check_config
    from dart_infer.common.configs import configs_dir
    from dart_infer.common.errors import InputError
    from dart_train.demo import train_config, trained_line

    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        defaults = compose(config_name="demo")
        assert defaults.train_steps == 250 and 0 < defaults.train_minutes <= 5  # ~10 minutes on 2 cores in all
        for bad, message in (("train_minutes=-1", "train_minutes=-1: must be >= 0"),
                             ("train_minutes=soon", "train_minutes=soon: expected a number")):
            with pytest.raises(InputError, match=f"^{message}$"):
                check_config("dart-demo", compose(config_name="demo", overrides=[bad]), defaults)
        cfg = compose(config_name="demo", overrides=[f"out_dir={tmp_path}", "train_minutes=0"])
        assert train_config(cfg, tmp_path / "full.ngt").trainer.max_minutes == 0  # 0: no time limit
        cfg = compose(config_name="demo", overrides=[f"out_dir={tmp_path}",
                                                     "train_overrides=['trainer.max_minutes=soon']"])
        with pytest.raises(InputError, match="^the demo's train stage: trainer.max_minutes=soon: expected a number$"):
            train_config(cfg, tmp_path / "full.ngt")
    budget = {"steps": 38, "total_steps": 250, "tokens": 1234567, "minutes": 4.04, "stopped_on": "time_budget",
              "max_minutes": 4.0}
    assert trained_line(budget) == ("[demo 2/3] trained 38 of 250 steps, 1,234,567 tokens in 4.0 minutes "
                                    "(stopped by the time budget, train_minutes=4)")
    assert trained_line({**budget, "steps": 250, "stopped_on": "max_steps"}) == (
        "[demo 2/3] trained 250 of 250 steps, 1,234,567 tokens in 4.0 minutes")


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_console_scripts_run_under_tcmalloc_unless_told_otherwise(name: str, tmp_path: Path) -> None:
    # dart_infer.common.allocator re-executes the script with tcmalloc preloaded (~1.2x faster CPU training);
    # the line comes from the process's own memory map, so it says what the process really runs with.
    from dart_infer.common.allocator import find_tcmalloc

    assert find_tcmalloc(), "tcmalloc is not installed: `make venv` installs libtcmalloc-minimal4"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DART_ALLOCATOR")}

    def first_line(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([_script(name), "--cfg", "job"], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120, env={**env, **extra})

    default = first_line()
    assert default.returncode == 0, default.stderr[-3000:]
    assert default.stdout.splitlines()[0].startswith("# allocator: tcmalloc"), default.stdout[:300]
    assert default.stdout.count("# allocator:") == 1  # re-executed once, not in a loop
    system = first_line(DART_ALLOCATOR="system")
    assert system.stdout.splitlines()[0] == "# allocator: glibc (DART_ALLOCATOR=system)"
    missing = first_line(DART_ALLOCATOR=str(tmp_path / "libnothing.so"))
    assert missing.returncode != 0 and "DART_ALLOCATOR" in missing.stderr and "no such file" in missing.stderr
