"""`dart-train` end to end on a tiny random Llama (CI-sized), resume/refuse, config errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import TRAIN_CONVERSATIONS, compose_train, run_train_cli, train_overrides
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dart_infer.common.configs import configs_dir


def test_dart_train_end_to_end_then_resume_or_refuse(tiny_checkpoint, conversations_file, tmp_path) -> None:
    from dart_infer.decoding.dart_model import DartModel

    out = tmp_path / "run"
    result = run_train_cli(train_overrides(tiny_checkpoint, conversations_file, out), tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "# resolved config (train)" in result.stdout
    assert "# dart-train: peak memory estimate of the head's step (dense-mask attention)" in result.stdout
    saved = OmegaConf.load(out / "config.yaml")
    assert saved.trainer.max_steps == 3 and saved.model.name_or_path == str(tiny_checkpoint)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m and "eval/tau" not in m] == [1, 2, 3]
    taus = [m["eval/tau"] for m in metrics if "eval/tau" in m]
    assert len(taus) == 2 and all(t >= 1.0 for t in taus)
    assert (out / "best" / "best.json").is_file()

    # The exported head loads through the serving API and decodes.
    dart = DartModel.from_pretrained(str(tiny_checkpoint), str(out / "head"))
    assert dart.draft_model.config.draft_length == 4
    prompt = dart.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from 3 to 8, please."}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    generated = dart.dart_generate(prompt, max_new_token_num=8)
    reference = dart.base_model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(generated[0, : reference.shape[1]], reference[0, : generated.shape[1]])

    # Same output dir again: refused without resume=true, nothing overwritten.
    before = (out / "metrics.jsonl").read_text()
    again = run_train_cli(train_overrides(tiny_checkpoint, conversations_file, out), tmp_path)
    assert again.returncode != 0
    assert "already holds a run" in again.stderr and "resume=true" in again.stderr
    assert (out / "metrics.jsonl").read_text() == before

    # resume=true with a larger budget continues from step 3, configured as the saved run was: only
    # what this command line names changes (no need to repeat the model, data, ... overrides).
    more = run_train_cli([f"output_dir={out}", "resume=true", "trainer.max_steps=5"], tmp_path)
    assert more.returncode == 0, more.stderr[-4000:]
    assert "resume: trainer.max_steps: 3 -> 5" in more.stdout + more.stderr
    resumed = OmegaConf.load(out / "config.yaml")
    assert resumed.trainer.max_steps == 5 and resumed.model.name_or_path == str(tiny_checkpoint)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line) and "eval/tau" not in json.loads(line)]
    assert steps == [1, 2, 3, 4, 5]
    # A change the checkpoint cannot continue with is refused, saying how; an optimiser one is applied.
    refused = run_train_cli([f"output_dir={out}", "resume=true", "trainer.max_steps=6", "trainer.zero_stage=2"], tmp_path)
    assert refused.returncode != 0 and "resume with trainer.zero_stage=0" in refused.stderr
    applied = run_train_cli([f"output_dir={out}", "resume=true", "trainer.max_steps=6", "optim.lr=0.5"], tmp_path)
    assert applied.returncode == 0, applied.stderr[-4000:]
    assert "resume: optim.lr: 2e-05 -> 0.5 (applied to the restored optimiser/schedule)" in applied.stdout + applied.stderr
    # resume=true on the finished run (step 6 of 6): nothing to train, what the run measured is kept.
    summary = (out / "summary.json").read_bytes()
    assert json.loads(summary)["steps"] == 6 and json.loads(summary)["final_loss"] is not None
    finished = run_train_cli([f"output_dir={out}", "resume=true"], tmp_path)
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert "already finished at step 6" in finished.stdout + finished.stderr
    assert (out / "summary.json").read_bytes() == summary


def test_defaults_compose_with_paper_recipe() -> None:
    cfg = compose_train()
    assert cfg.model.name_or_path == "smollm2-135m-instruct"
    assert cfg.data.source == "sharegpt" and cfg.data.split == "train"
    assert cfg.optim.lr == 2e-5 and list(cfg.optim.betas) == [0.9, 0.999] and cfg.optim.grad_clip == 0.5
    assert cfg.optim.epochs == 3 and cfg.optim.gamma == 0.6
    assert cfg.draft.draft_length == 8
    assert cfg.train_eval.tree.remain_total >= 1
    zero3 = compose_train("trainer=zero3")
    assert zero3.trainer.zero_stage == 3 and zero3.trainer.bf16


def test_resumed_config_keeps_the_saved_run_except_named_keys() -> None:
    from dart_train.trainer.run_dir import resumed_config

    saved = compose_train("optim.lr=0.01", "trainer.max_steps=3", "trainer=zero2")
    new = compose_train("trainer.max_steps=5", "resume=true")
    merged, changes = resumed_config(new, saved, ["trainer.max_steps", "resume"])
    assert merged.optim.lr == 0.01 and merged.trainer.zero_stage == 2  # restored, not the defaults
    assert merged.trainer.max_steps == 5 and changes == ["trainer.max_steps: 3 -> 5"]
    assert new.optim.lr == 2e-5  # the caller's cfg is not modified
    # A group named on the command line changes every key under it.
    merged, changes = resumed_config(new, saved, ["trainer"])
    assert merged.trainer.zero_stage == 0 and "trainer.zero_stage: 2 -> 0" in changes
    # A Python caller's whole cfg wins; the differences are still reported.
    merged, changes = resumed_config(new, saved, None)
    assert merged.optim.lr == 2e-5 and "optim.lr: 0.01 -> 2e-05" in changes


def test_unknown_keys_are_errors() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_train("trainer.max_step=3")  # typo of max_steps
    with pytest.raises(ConfigCompositionException):
        compose_train("optim.learning_rate=1e-4")


def test_max_minutes_is_a_number_of_minutes_or_null(tmp_path: Path) -> None:
    from dart_infer.cli.checks import check_config
    from dart_infer.common.errors import InputError
    from dart_train.builders import settings_from_config

    assert settings_from_config(compose_train()).max_minutes is None  # the default: no time limit
    assert settings_from_config(compose_train("trainer.max_minutes=2.5")).max_minutes == 2.5
    assert settings_from_config(compose_train("trainer.max_minutes=0")).max_minutes is None
    with pytest.raises(InputError, match=r"^trainer.max_minutes=-1: must be >= 0$"):
        check_config("dart-train", compose_train("trainer.max_minutes=-1"), compose_train())
    with pytest.raises(InputError, match=r"^trainer.max_minutes=soon: expected a number$"):
        settings_from_config(compose_train("trainer.max_minutes=soon"))
    # The command refuses it in one line (exit 2) before loading anything.
    result = run_train_cli(["trainer.max_minutes=soon", f"output_dir={tmp_path / 'run'}"], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == "dart-train: error: trainer.max_minutes=soon: expected a number"


def test_run_dir_checks(tmp_path: Path) -> None:
    from dart_train.trainer.run_dir import RunDirError, prepare_run_dir

    run = tmp_path / "r"
    assert prepare_run_dir(run, resume=False) is False
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match="resume=true"):
        prepare_run_dir(run, resume=False)
    assert prepare_run_dir(run, resume=True) is True
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        with pytest.raises(RunDirError, match="not writable"):
            prepare_run_dir(locked / "run", resume=False)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match="not writable"):
        prepare_run_dir(blocker / "run", resume=False)


def test_draft_config_that_does_not_fit_the_target(tiny_checkpoint, conversations_file, tmp_path) -> None:
    from dart_train.cli import train

    cfg = compose_train(*train_overrides(tiny_checkpoint, conversations_file, tmp_path / "a", "draft.draft_vocab_size=10000000"))
    with pytest.raises(ValueError, match="does not fit the target"):
        train(cfg)
    cfg = compose_train(*train_overrides(tiny_checkpoint, conversations_file, tmp_path / "b", "trainer.zero_stage=5"))
    with pytest.raises(ValueError, match="zero_stage"):
        train(cfg)


def test_dataset_without_assistant_turns_is_a_clear_error(tiny_checkpoint, tmp_path) -> None:
    from dart_train.cli import train

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "hello"}) + "\n")
    cfg = compose_train(*train_overrides(tiny_checkpoint, data, tmp_path / "run"))
    with pytest.raises(ValueError, match="empty dataset"):
        train(cfg)


def test_deepspeed_launcher_local_rank_argument(monkeypatch) -> None:
    import dart_train.cli as cli

    seen = {}
    monkeypatch.setattr(cli, "_hydra_main", lambda: seen.setdefault("argv", list(sys.argv[1:])))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["dart-train", "--local_rank=3", "trainer=zero2", "seed=1"])
    cli.main()
    assert seen["argv"] == ["trainer=zero2", "seed=1"]
    assert os.environ["LOCAL_RANK"] == "3"


def test_states_target_is_a_bf16_copy_and_the_head_keeps_the_served_embedding(tiny_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    from dart_train.builders import load_target

    served = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).get_input_embeddings().weight
    base = ["model=custom", f"model.name_or_path={tiny_checkpoint}"]
    target, _, embedding = load_target(compose_train(*base, "states.target_dtype=bfloat16"))
    assert target.dtype == torch.bfloat16 and next(target.model.parameters()).dtype == torch.bfloat16
    assert embedding.dtype == torch.float32 and torch.equal(embedding, served)
    target, _, embedding = load_target(compose_train(*base, "states.target_dtype=float32"))
    assert target.dtype == torch.float32 and torch.equal(embedding, served)
    with pytest.raises(ValueError, match="unknown dtype"):
        load_target(compose_train(*base, "states.target_dtype=bf17"))


def test_init_output_from_target_copies_the_target_rows(tiny_checkpoint, conversations_file, tmp_path) -> None:
    from dart_train.builders import build_head, load_target

    cfg = compose_train(*train_overrides(tiny_checkpoint, conversations_file, tmp_path / "run"),
                   "draft.init_output_from_target=true", "states.target_dtype=float32")
    target, _, embedding = load_target(cfg)
    with torch.no_grad():
        target.model.model.norm.weight.mul_(1.5)  # not the draft norm's default of ones
    mapping = torch.arange(0, 1024, 2)  # every other target id
    head = build_head(target, cfg, lambda n: mapping[:n], embedding)
    output = target.model.get_output_embeddings().weight
    assert torch.equal(head.lm_head.weight, output[mapping])
    assert torch.equal(head.norm.weight, target.model.model.norm.weight)
    plain = build_head(target, compose_train(*train_overrides(tiny_checkpoint, conversations_file, tmp_path / "b")),
                       lambda n: mapping[:n], embedding)
    assert not torch.equal(plain.lm_head.weight, output[mapping])


def test_regenerate_only_then_resume_trains_with_the_saved_config(tiny_checkpoint, conversations_file, tmp_path):
    out, regen = tmp_path / "run", tmp_path / "regen.jsonl"
    first = run_train_cli(train_overrides(tiny_checkpoint, conversations_file, out, "preprocess.regenerate.enabled=true",
                              "preprocess.regenerate.stop_after=true", "preprocess.regenerate.max_new_tokens=4",
                              "preprocess.regenerate.max_turns=1", f"preprocess.regenerate.output={regen}"), tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "stopping (preprocess.regenerate.stop_after)" in first.stdout and not (out / "metrics.jsonl").exists()
    rows = [json.loads(line) for line in regen.read_text().splitlines()]
    assert len(rows) == len(TRAIN_CONVERSATIONS) and all(len(r["messages"]) == 2 for r in rows)  # first turns only
    # resume=true on that directory continues the saved run (tiny model, its data) instead of the defaults.
    more = run_train_cli([f"output_dir={out}", "resume=true", "preprocess.regenerate.stop_after=false"], tmp_path)
    assert more.returncode == 0, more.stderr[-4000:]
    assert OmegaConf.load(out / "config.yaml").model.name_or_path == str(tiny_checkpoint)
    assert (out / "head" / "model.safetensors").is_file()


def test_states_target_keeps_float32_rotary_tables(tiny_checkpoint) -> None:
    """The bf16 copy is cast like transformers loads bf16 (parameters only): rounding the rotary
    inv_freq buffer to bf16 would shift every position's rotation (worse the longer the sequence)."""
    from dart_train.builders import load_target

    target, _, _ = load_target(compose_train("model=custom", f"model.name_or_path={tiny_checkpoint}",
                                         "states.target_dtype=bfloat16"))
    buffers = {name: b.dtype for name, b in target.model.named_buffers() if "inv_freq" in name}
    assert buffers and set(buffers.values()) == {torch.float32}


def test_regenerated_data_is_keyed_by_its_settings(tmp_path) -> None:
    from dart_train.builders import _regenerate_options, regenerate_output

    base = [f"output_root={tmp_path}"]
    default = regenerate_output(compose_train(*base))
    assert default.parent == tmp_path / "regenerated" / "smollm2-135m-instruct" and default.suffix == ".jsonl"
    assert regenerate_output(compose_train(*base)) == default  # the same settings: the same file (resumable)
    changed = {regenerate_output(compose_train(*base, f"preprocess.regenerate.{key}"))
               for key in ("temperature=0.7", "max_new_tokens=64", "top_p=0.9", "seed=1", "max_turns=1",
                           "keep_truncated=false", "max_prompt_tokens=100")}
    changed.add(regenerate_output(compose_train(*base, "model=custom", "model.name_or_path=org/other")))
    changed.add(regenerate_output(compose_train(*base, "preprocess=qwen3-nothink")))  # template options
    changed.add(regenerate_output(compose_train(*base, "model.chat_template=plain")))  # another rendering
    assert len(changed) == 10 and default not in changed
    assert regenerate_output(compose_train(*base, "preprocess.regenerate.output=/x/y.jsonl")) == Path("/x/y.jsonl")
    # keep_truncated reaches dart_train.data.regenerate (its effect: tests/test_regenerate.py).
    assert _regenerate_options(compose_train("preprocess.regenerate.keep_truncated=false"))["keep_truncated"] is False
    assert _regenerate_options(compose_train())["keep_truncated"] is True


def test_resumed_runs_log_to_a_new_wandb_segment(tmp_path) -> None:
    from dart_train.builders import wandb_init_kwargs

    cfg = compose_train("logging.wandb.mode=offline")
    first = wandb_init_kwargs(cfg, tmp_path / "my-run")
    assert (first["id"], first["group"], first["mode"]) == ("my-run", "my-run", "offline")
    resumed = wandb_init_kwargs(cfg, tmp_path / "my-run", resume_step=200)
    assert (resumed["id"], resumed["group"]) == ("my-run-from00000200", "my-run")
    assert resumed["config"]["resumed_from_step"] == 200


def test_hardware_group_sets_trainer_tree_and_dtype_together() -> None:
    from dart_infer.tree.settings import CPU_TREE

    cpu, gpu = compose_train(), compose_train("hardware=gpu")
    # The CPU tree of configs/tree/cpu.yaml, the same as DartModel's CPU default.
    assert (cpu.trainer.zero_stage, cpu.model.dtype, cpu.train_eval.tree.remain_total) == (0, "float32", CPU_TREE.remain_total)
    assert cpu.train_eval.tree.copy_span_tokens == CPU_TREE.copy_span_tokens
    assert (gpu.trainer.zero_stage, gpu.trainer.bf16, gpu.model.dtype) == (2, True, "bfloat16")
    assert gpu.train_eval.tree.remain_total == 60 and gpu.trainer.max_anchors == 512  # the paper's tree, bounded
    # What the command line names still wins.
    mixed = compose_train("hardware=gpu", "trainer=zero3", "model.dtype=float32")
    assert (mixed.trainer.zero_stage, mixed.model.dtype, mixed.train_eval.tree.remain_total) == (3, "float32", 60)
    for name in ("zero2", "zero3"):
        assert compose_train(f"trainer={name}").trainer.max_anchors is not None  # GPU memory linear in tokens
    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        auto = compose(config_name="eval")
        on_gpu = compose(config_name="eval", overrides=["hardware=gpu"])
    assert auto.tree.remain_total == "auto" and on_gpu.tree.remain_total == 60 and on_gpu.model.dtype == "bfloat16"
