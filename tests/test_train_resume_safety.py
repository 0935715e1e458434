"""Resuming `dart-train` never costs a run its work: a mistyped output_dir, an unreadable or stale
checkpoint, a refused resume and Ctrl-C / SIGTERM, each on constructed bad input (tiny random models)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import compose_train, losses, make_trainer, train_overrides

from dart_infer.common.errors import InputError

STEP_4, STEP_6 = "step_00000004", "step_00000006"


def files_of(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path: equal before and after = nothing changed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a kill or a full disk mid-write


def garble(path: Path) -> None:
    path.write_bytes(b"\x00garbage" * 64)


def one_line_error(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# ------------------------------------------------------------------------------------- engine level


@pytest.fixture(scope="module")
def finished_run(tiny_target, tiny_dataset, tmp_path_factory) -> tuple[Path, list[float]]:
    """6 steps, a checkpoint every 2, the last 2 kept (step_4, step_6); and its losses: the reference."""
    run = tmp_path_factory.mktemp("reference") / "run"
    make_trainer(tiny_target, tiny_dataset, run).train()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [STEP_4, STEP_6]
    return run, losses(run)


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run[0], copy)
    return copy


@pytest.mark.parametrize("damage, file", [
    (truncate, "mp_rank_00_model_states.pt"),
    (garble, "mp_rank_00_model_states.pt"),
    (os.remove, "mp_rank_00_model_states.pt"),
    (truncate, "rank_state_00000.pt"),
    (garble, "rank_state_00000.pt"),
])
def test_unreadable_newest_checkpoint_falls_back_to_the_one_before(
    tiny_target, tiny_dataset, finished_run, run_copy, caplog, damage, file
) -> None:
    damage(run_copy / "checkpoints" / STEP_6 / file)
    trainer = make_trainer(tiny_target, tiny_dataset, run_copy)
    with caplog.at_level("WARNING"):
        assert trainer.resume()
    assert trainer.step == 4
    # Loud: the warning names the unreadable checkpoint, the file and the one resumed instead.
    warning = next(r.getMessage() for r in caplog.records if "cannot be loaded" in r.getMessage())
    assert STEP_6 in warning and STEP_4 in warning and (file in warning or "model state" in warning), warning
    # The unreadable tag is kept aside (not deleted, not rotated, not chosen again); latest names step 4.
    checkpoints = run_copy / "checkpoints"
    (aside,) = checkpoints.glob(f"aside-{STEP_6}-*")
    assert (checkpoints / "latest").read_text() == STEP_4 and not (checkpoints / STEP_6).exists()
    # The run continues exactly from step 4: the same losses as the uninterrupted run.
    trainer.train()
    assert losses(run_copy) == finished_run[1]
    assert sorted(p.name for p in checkpoints.glob("step_*")) == [STEP_4, STEP_6]


def test_stale_latest_falls_back_to_the_newest_checkpoint_on_disk(tiny_target, tiny_dataset, run_copy, caplog) -> None:
    checkpoints = run_copy / "checkpoints"
    shutil.rmtree(checkpoints / STEP_6)  # latest still names it (deleted by hand)
    with caplog.at_level("WARNING"):
        trainer = make_trainer(tiny_target, tiny_dataset, run_copy)
        assert trainer.resume() and trainer.step == 4
    assert "stale" in caplog.text and STEP_6 in caplog.text
    (checkpoints / "latest").write_text("step_00000099")  # a tag that never existed
    assert make_trainer(tiny_target, tiny_dataset, run_copy).resume()


def test_no_intact_checkpoint_is_an_input_error_that_changes_nothing(tiny_target, tiny_dataset, run_copy) -> None:
    checkpoints = run_copy / "checkpoints"
    truncate(checkpoints / STEP_6 / "mp_rank_00_model_states.pt")
    garble(checkpoints / STEP_4 / "rank_state_00000.pt")
    before = files_of(run_copy)
    with pytest.raises(InputError) as exc:
        make_trainer(tiny_target, tiny_dataset, run_copy).resume()
    text = one_line_error(exc)
    assert f"{checkpoints} holds no intact checkpoint" in text
    assert STEP_6 in text and STEP_4 in text and f"Move {checkpoints} away" in text and "another output_dir" in text
    assert files_of(run_copy) == before
    # latest naming a tag when no checkpoint folder is left: the same kind of refusal.
    shutil.rmtree(checkpoints / STEP_4)
    shutil.rmtree(checkpoints / STEP_6)
    before = files_of(run_copy)
    with pytest.raises(InputError, match="holds no checkpoint folder"):
        make_trainer(tiny_target, tiny_dataset, run_copy).resume()
    assert files_of(run_copy) == before


def test_a_first_save_that_never_finished_starts_the_run_again(tiny_target, tiny_dataset, tmp_path, caplog) -> None:
    run = tmp_path / "run"
    make_trainer(tiny_target, tiny_dataset, run, max_steps=2).train()  # step_2
    checkpoints = run / "checkpoints"
    (checkpoints / "latest").unlink()  # killed inside the first save: DeepSpeed writes latest last
    truncate(checkpoints / "step_00000002" / "mp_rank_00_model_states.pt")
    with caplog.at_level("WARNING"):
        assert not make_trainer(tiny_target, tiny_dataset, run, max_steps=2).resume()
    assert "never finished" in caplog.text
    assert not (checkpoints / "step_00000002").exists() and list(checkpoints.glob("aside-step_00000002-*"))


@pytest.mark.parametrize("sig, save_every", [(signal.SIGINT, None), (signal.SIGTERM, 3)])
def test_signal_stops_at_a_step_with_a_checkpoint_that_resumes_exactly(
    tiny_target, tiny_dataset, finished_run, tmp_path, caplog, sig, save_every
) -> None:
    run = tmp_path / "run"
    trainer = make_trainer(tiny_target, tiny_dataset, run, save_every=save_every)
    source, calls, saves = trainer.state_source, [], []

    def signalling_source(batch):
        calls.append(1)
        if len(calls) == 5:  # the first micro-batch of step 3 (grad_accum=2)
            assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.default_int_handler), "no handler"
            os.kill(os.getpid(), sig)
        return source(batch)

    save = trainer.save_checkpoint
    trainer.save_checkpoint = lambda: saves.append(trainer.step) or save()
    trainer.state_source = signalling_source
    handler = signal.getsignal(sig)
    with caplog.at_level("WARNING"), pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert signal.getsignal(sig) is handler  # restored
    # Stopped at the end of step 3 (its second micro-batch ran), with exactly one checkpoint of step 3.
    assert len(calls) == 6 and saves == [3]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000003"
    assert f"output_dir={run} resume=true" in caplog.text
    assert ("checkpoint saved to" if save_every is None else "nothing to save") in caplog.text
    resumed = make_trainer(tiny_target, tiny_dataset, run, save_every=save_every)
    assert resumed.resume() and resumed.step == 3
    resumed.train()
    assert losses(run) == finished_run[1]


def test_a_second_signal_stops_at_once_without_a_checkpoint(tiny_target, tiny_dataset, tmp_path) -> None:
    trainer = make_trainer(tiny_target, tiny_dataset, tmp_path, save_every=None)
    source, calls = trainer.state_source, []

    def signalling_source(batch):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # raises KeyboardInterrupt here
        return source(batch)

    trainer.state_source = signalling_source
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert len(calls) == 3 and not (tmp_path / "checkpoints").exists()


# ---------------------------------------------------------------------------------------- dart-train


def test_run_dir_modes(tmp_path: Path) -> None:
    from dart_train.trainer.run_dir import RunDirError, prepare_run_dir

    typo = tmp_path / "runs" / "my-haed"
    with pytest.raises(RunDirError) as exc:
        prepare_run_dir(typo, "true")
    assert one_line_error(exc) == (
        f"resume=true: {typo} holds no run to resume (no checkpoints/, config.yaml or metrics). Check "
        "output_dir, or use resume=auto to continue a run if it exists and start a new one otherwise."
    )
    assert isinstance(exc.value, InputError) and not typo.exists()  # nothing created
    typo.mkdir(parents=True)
    (typo / "notes.txt").write_text("an empty directory is no run either")
    with pytest.raises(RunDirError, match="holds no run to resume"):
        prepare_run_dir(typo, True)
    fresh = tmp_path / "fresh"
    assert prepare_run_dir(fresh, "auto") is False and fresh.is_dir()  # auto: a new run
    (fresh / "config.yaml").write_text("seed: 0\n")  # killed before its first checkpoint: still a run
    assert prepare_run_dir(fresh, "auto") is True and prepare_run_dir(fresh, True) is True
    with pytest.raises(RunDirError, match="already holds a run \\(config.yaml\\)"):
        prepare_run_dir(fresh, False)
    with pytest.raises(InputError, match="resume='maybe' is not a resume mode"):
        prepare_run_dir(fresh, "maybe")


def test_resume_true_without_a_run_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    from dart_train.cli import train

    out = tmp_path / "mistyped"
    # No such model or data: loading either would fail differently.
    cfg = compose_train(*train_overrides(tmp_path / "no-model", tmp_path / "no-data.jsonl", out), "resume=true")
    with pytest.raises(InputError, match=f"resume=true: {out} holds no run to resume"):
        train(cfg)
    assert not out.exists()


@pytest.fixture(scope="module")
def cli_run(tiny_checkpoint, conversations_file, tmp_path_factory) -> Path:
    """A 3-step dart-train run started with resume=auto on a new directory (checkpoints 2 and 3)."""
    from dart_train.cli import train

    out = tmp_path_factory.mktemp("cli") / "run"
    summary = train(compose_train(*train_overrides(tiny_checkpoint, conversations_file, out), "train_eval.enabled=false",
                             "resume=auto"))
    assert summary["steps"] == 3 and (out / "checkpoints" / "latest").read_text() == "step_00000003"
    return out


def _cli_copy(cli_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(cli_run, copy)
    return copy


def _cfg(checkpoint: Path, data: Path, out: Path, *extra: str):
    return compose_train(*train_overrides(checkpoint, data, out), "train_eval.enabled=false", *extra)


def test_resume_auto_continues_an_existing_run(cli_run, tiny_checkpoint, conversations_file, tmp_path) -> None:
    from dart_train.cli import train

    run = _cli_copy(cli_run, tmp_path)
    summary = train(_cfg(tiny_checkpoint, conversations_file, run, "resume=auto", "trainer.max_steps=4"))
    assert summary["steps"] == 4
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_refused_resumes_change_no_file_of_the_run(
    cli_run, tiny_checkpoint, conversations_file, tmp_path, monkeypatch
) -> None:
    from deepspeed import DeepSpeedEngine

    from dart_train.cli import train
    from dart_train.trainer.engine import ResumeError

    run = _cli_copy(cli_run, tmp_path)
    before = files_of(run)
    # A setting the checkpoint cannot continue with (refused before the model loads).
    with pytest.raises(ResumeError) as exc:
        train(_cfg(tiny_checkpoint, conversations_file, run, "resume=true", "trainer.zero_stage=2"))
    assert "resume with trainer.zero_stage=0" in one_line_error(exc) and isinstance(exc.value, InputError)
    assert files_of(run) == before
    # A checkpoint whose files pass the cheap check but that DeepSpeed cannot load (after the model
    # loaded): refused, naming it, and config.yaml is not rewritten with this command's settings.
    def corrupt_inside(self, load_dir, tag=None, **kwargs):
        raise RuntimeError("PytorchStreamReader failed reading file data/0: invalid header or archive is corrupted")

    with monkeypatch.context() as patch:
        patch.setattr(DeepSpeedEngine, "load_checkpoint", corrupt_inside)
        with pytest.raises(InputError) as exc:
            train(_cfg(tiny_checkpoint, conversations_file, run, "resume=true", "trainer.max_steps=5"))
    assert f"checkpoint {run / 'checkpoints' / 'step_00000003'} could not be loaded" in one_line_error(exc)
    assert files_of(run) == before
    # No checkpoint intact: refused before the model loads.
    for tag in ("step_00000002", "step_00000003"):
        truncate(run / "checkpoints" / tag / "mp_rank_00_model_states.pt")
    before = files_of(run)
    with pytest.raises(InputError, match="holds no intact checkpoint"):
        train(_cfg(tmp_path / "no-model", conversations_file, run, "resume=true", "trainer.max_steps=5"))
    assert files_of(run) == before


def test_ctrl_c_in_dart_train_saves_and_the_run_continues(
    cli_run, tiny_checkpoint, conversations_file, tmp_path, monkeypatch, caplog
) -> None:
    from dart_train.cli import train
    from dart_train.trainer.engine import DartTrainer

    run = _cli_copy(cli_run, tmp_path)
    step = DartTrainer._micro_step

    def interrupted_step(self, batch):
        if self.step == 3:  # the first micro-batch of step 4 (grad_accum=1)
            os.kill(os.getpid(), signal.SIGINT)
        return step(self, batch)

    with monkeypatch.context() as patch, caplog.at_level("WARNING"):
        patch.setattr(DartTrainer, "_micro_step", interrupted_step)
        with pytest.raises(KeyboardInterrupt):
            train(_cfg(tiny_checkpoint, conversations_file, run, "resume=true", "trainer.max_steps=6",
                       "trainer.save_every=null"))
    assert (run / "checkpoints" / "latest").read_text() == "step_00000004"
    assert f"continue with: dart-train output_dir={run} resume=true" in caplog.text
    summary = train(_cfg(tiny_checkpoint, conversations_file, run, "resume=true", "trainer.max_steps=6"))
    assert summary["steps"] == 6
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_ctrl_c_on_the_command_saves_a_checkpoint_and_exits_130(tiny_checkpoint, conversations_file, tmp_path) -> None:
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    args = train_overrides(tiny_checkpoint, conversations_file, out, "train_eval.enabled=false", "trainer.max_steps=100000",
                     "trainer.save_every=100000")
    process = subprocess.Popen(
        [sys.executable, "-c", "from dart_train.cli import main; main()", *args, f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # training has started once step 1 is logged
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 130, stderr[-4000:]
    tag = (out / "checkpoints" / "latest").read_text()
    step = int(tag.removeprefix("step_"))
    assert step >= 1 and f"checkpoint saved to {out / 'checkpoints' / tag}" in stdout + stderr
    assert f"continue with: dart-train output_dir={out} resume=true" in stdout + stderr
    assert "dart-train: interrupted" in stderr

