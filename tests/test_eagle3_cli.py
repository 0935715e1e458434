"""`dart-train draft=eagle3` end to end on a tiny random Llama: TTT training through DART's engine,
simulated τ on EAGLE-3's own tree, export in the published layout, lossless serving of the export, resume."""

from __future__ import annotations

import json

import torch
from helpers import run_train_cli, train_overrides
from omegaconf import OmegaConf


def test_dart_train_eagle3_end_to_end(tiny_checkpoint, conversations_file, tmp_path) -> None:
    from dart_infer.decoding.dart_model import DartModel

    out = tmp_path / "run"
    args = ["draft=eagle3", *train_overrides(tiny_checkpoint, conversations_file, out)]
    args = [a for a in args if not a.startswith("draft.draft_length=")] + ["draft.ttt_length=3"]
    result = run_train_cli(args, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    saved = OmegaConf.load(out / "config.yaml")
    assert saved.draft.method == "eagle3" and saved.draft.gamma == 0.8
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [m for m in metrics if "loss" in m and "eval/tau" not in m]
    assert [m["step"] for m in train_rows] == [1, 2, 3]
    assert all(f"alpha_{k}" in train_rows[0] for k in (1, 2, 3)) and "alpha_4" not in train_rows[0]
    taus = [m["eval/tau"] for m in metrics if "eval/tau" in m]
    assert len(taus) == 2 and all(t >= 1.0 for t in taus)

    config = json.loads((out / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 512
    assert config["ttt_length"] == 3 and len(config["eagle_aux_hidden_state_layer_ids"]) == 3
    model = DartModel.from_pretrained(str(tiny_checkpoint), str(out / "head"))  # the method from config.json
    assert model.method.name == "eagle3"
    prompt = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from 3 to 8, please."}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    generated = model.dart_generate(prompt, max_new_token_num=8)
    reference = model.base_model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(generated[0, : reference.shape[1]], reference[0, : generated.shape[1]])

    # resume=true continues the EAGLE-3 run from its checkpoint, configured as saved.
    more = run_train_cli([f"output_dir={out}", "resume=true", "trainer.max_steps=4"], tmp_path)
    assert more.returncode == 0, more.stderr[-4000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m and "eval/tau" not in m] == [1, 2, 3, 4]
    assert OmegaConf.load(out / "config.yaml").draft.method == "eagle3"


def test_dart_and_eagle3_runs_share_one_offline_state_cache(tiny_checkpoint, conversations_file, tmp_path) -> None:
    # The equal-budget comparison's cheap path: the target's states are computed once and both heads
    # train on them (the cache is keyed by target, aux layers, data and settings, not by the head).
    dart = run_train_cli([*train_overrides(tiny_checkpoint, conversations_file, tmp_path / "dart"), "states=offline",
                    "train_eval.enabled=false"], tmp_path)
    assert dart.returncode == 0, dart.stderr[-4000:]
    caches = sorted((tmp_path / "artifacts" / "state-cache").rglob("manifest.json"))
    assert len(caches) == 1
    shards = {p: p.stat().st_mtime_ns for p in caches[0].parent.glob("shard-*.safetensors")}
    args = [a for a in train_overrides(tiny_checkpoint, conversations_file, tmp_path / "eagle3") if not a.startswith("draft.")]
    eagle3 = run_train_cli(["draft=eagle3", *args, "draft.draft_vocab_size=512", "draft.ttt_length=3", "states=offline",
                      "train_eval.enabled=false"], tmp_path)
    assert eagle3.returncode == 0, eagle3.stderr[-4000:]
    assert sorted((tmp_path / "artifacts" / "state-cache").rglob("manifest.json")) == caches
    assert shards and {p: p.stat().st_mtime_ns for p in shards} == shards  # read, not recomputed
    assert f"offline states: {caches[0].parent}" in eagle3.stdout
    assert (tmp_path / "eagle3" / "head" / "config.json").is_file()
