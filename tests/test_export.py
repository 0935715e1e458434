"""`dart-export`: EAGLE-3 heads written for vLLM (speculators format) and SGLang, the fields those
engines read, one-line refusals, and vLLM itself serving an export losslessly (`vllm` marker: runs in
.venv-vllm, made by `make vllm`; fails, never skips, when it is missing). DART heads in vLLM (the
plugin): tests/test_vllm_plugin.py, which reuses this module's tiny target."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import ROOT, VLLM_VENV, load_target, one_thread
from safetensors import safe_open
from safetensors.torch import load_file

from dart_infer.cli.export import main as export_main
from dart_infer.decoding.dart_model import DartModel
from dart_infer.engines.export import SPEC_CONFIG_FILE, export_head
from dart_infer.methods.eagle3 import Eagle3DraftConfig, Eagle3DraftModel, load_eagle3_model

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,", "1, 2, 3, 4, 5,"]
SPEC_TOKENS = 3
MAX_NEW = 32


def fit_head(base, prompts: list[list[int]], steps: int = 300) -> Eagle3DraftModel:
    """An EAGLE-3 head that has memorised the target's greedy continuations of `prompts` for its
    FIRST draft token (step 0: aux_t + x_{t+1} -> x_{t+2}); later draft steps stay untrained. Served
    anywhere, its first draft is then accepted at every step, which needs the right aux layers,
    norms and vocabulary mapping."""
    seqs = [base.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW + 8, pad_token_id=0)[0]
            for p in prompts]
    config = Eagle3DraftConfig.from_target_config(base.config, draft_vocab_size=512, ttt_length=SPEC_TOKENS)
    head = Eagle3DraftModel(config)
    used = torch.unique(torch.cat(seqs))
    others = torch.tensor(sorted(set(range(512 + used.numel())) - set(used.tolist())))[: 512 - used.numel()]
    head.set_vocab_mapping(torch.cat([used, others]).sort().values)
    head.set_target_embedding(base.get_input_embeddings().weight)
    draft_id = torch.full((config.vocab_size,), -1)
    draft_id[head.draft_to_target(torch.arange(512))] = torch.arange(512)
    batches = []
    with torch.no_grad():
        for seq in seqs:
            states = base(seq[None], output_hidden_states=True).hidden_states
            aux = torch.cat([states[i] for i in config.eagle_aux_hidden_state_layer_ids], dim=-1)
            batches.append((aux[:, :-2], seq[None, 1:-1], draft_id[seq[2:]]))
    torch.manual_seed(0)
    optimizer = torch.optim.Adam([p for n, p in head.named_parameters() if "embed" not in n], lr=3e-3)
    for _ in range(steps):
        loss = sum(
            torch.nn.functional.cross_entropy(
                head.step(head.project(aux), ids, torch.arange(ids.shape[1])[None], None)[1][0], labels)
            for aux, ids, labels in batches
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


@pytest.fixture(scope="module")
def fitted(vllm_target_dir, smollm2_tokenizer, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """(saved fitted head as dart-train writes it, token-id prompts)."""
    prompts = [smollm2_tokenizer(text).input_ids for text in TEXTS]
    with one_thread():
        head = fit_head(load_target(vllm_target_dir), prompts)
    out = tmp_path_factory.mktemp("run") / "head"
    head.save_pretrained(out)
    return out, prompts


def safetensors_keys(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as fh:
        return set(fh.keys())


def test_vllm_export_writes_the_speculators_fields_vllm_reads(fitted, vllm_target_dir, tmp_path: Path) -> None:
    head_dir, _ = fitted
    result = export_head(str(head_dir), tmp_path / "export", "vllm", target=str(vllm_target_dir), num_speculative_tokens=4)
    out = tmp_path / "export"
    config = json.loads((out / "config.json").read_text())
    head_config = json.loads((head_dir / "config.json").read_text())
    # vLLM detects the format by `speculators_config` when there is no model_type
    # (transformers_utils/config.py) and validates these keys (SpeculatorsConfig.validate_speculators_config).
    assert "model_type" not in config and config["speculators_model_type"] == "eagle3"
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": str(vllm_target_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and not layer["tie_word_embeddings"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "vocab_size", "rope_parameters", "max_position_embeddings"):
        assert layer[key] == head_config[key], key
    assert not {"ttt_length", "draft_vocab_size", "architectures"} & set(layer)
    # update_eagle3 reads these at the top level; norm_before_residual defaults to TRUE there.
    assert config["norm_before_residual"] is False
    assert config["draft_vocab_size"] == 512 and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # Weights: vLLM's names (midlayer. -> layers.0.), no embedding (vLLM shares the target's).
    saved = load_file(str(out / "model.safetensors"))
    original = load_file(str(head_dir / "model.safetensors"))  # the published EAGLE-3 keys (test_eagle3)
    assert set(saved) == {k.replace("midlayer.", "layers.0.") for k in original}
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight", "d2t", "t2d"} <= set(saved)
    assert not any("embed_tokens" in k or "midlayer" in k for k in saved)
    for key, tensor in original.items():
        assert torch.equal(saved[key.replace("midlayer.", "layers.0.")], tensor), key
    assert json.loads((out / SPEC_CONFIG_FILE).read_text()) == {
        "model": str(out.resolve()), "method": "eagle3", "num_speculative_tokens": 4}
    assert result.speculative_config["model"] == str(out.resolve())


def test_sglang_export_keeps_our_layout_and_names_layer_outputs(fitted, vllm_target_dir, tmp_path: Path) -> None:
    head_dir, _ = fitted
    export_head(str(head_dir), tmp_path / "sgl", "sglang", target=str(vllm_target_dir))
    config = json.loads((tmp_path / "sgl" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["tie_word_embeddings"] is False
    # SGLang captures the output of layer id (= our id - 1); vLLM reads the top-level key first.
    assert config["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert safetensors_keys(tmp_path / "sgl" / "model.safetensors") == safetensors_keys(head_dir / "model.safetensors")
    spec = json.loads((tmp_path / "sgl" / SPEC_CONFIG_FILE).read_text())
    assert spec == {"model": str((tmp_path / "sgl").resolve()), "method": "eagle3", "num_speculative_tokens": 3}
    # Our own loader reads it back unchanged.
    back, ours = load_eagle3_model(str(tmp_path / "sgl")).state_dict(), load_eagle3_model(str(head_dir)).state_dict()
    assert all(torch.equal(back[k], ours[k]) for k in ours)


def test_bf16_head_stays_bf16_and_the_target_comes_from_the_run(vllm_target_dir, tmp_path: Path) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(vllm_target_dir)
    head = Eagle3DraftModel(Eagle3DraftConfig.from_target_config(config, draft_vocab_size=64)).to(torch.bfloat16)
    head.save_pretrained(tmp_path / "run" / "head")
    # A dart-train run records its target in <run>/config.yaml; the export finds it there.
    (tmp_path / "run" / "config.yaml").write_text(f"model:\n  name_or_path: {vllm_target_dir}\n")
    export_main([str(tmp_path / "run" / "head"), "--out", str(tmp_path / "out")])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(vllm_target_dir.resolve())
    assert config["torch_dtype"] == "bfloat16"
    assert {t.dtype for k, t in load_file(str(tmp_path / "out" / "model.safetensors")).items()
            if k not in ("d2t", "t2d")} == {torch.bfloat16}


def refusal(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        export_main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dart-export: error: "), err
    return lines[0]


def test_bad_input_is_refused_in_one_line(fitted, tmp_path: Path, capsys) -> None:
    head_dir, _ = fitted
    assert "no such directory" in refusal(capsys, [str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "did you mean dart-smollm2-135m-instruct" in refusal(
        capsys, ["dart-smollm2-135m-instruc", "--out", str(tmp_path / "o")])
    # DART heads export for vLLM (tests/test_vllm_plugin.py); SGLang has no DART support.
    line = refusal(capsys, ["dart-smollm2-135m-instruct", "--out", str(tmp_path / "o"), "--format", "sglang"])
    assert "a DART head" in line and "vLLM only" in line
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert "not empty" in refusal(capsys, [str(head_dir), "--out", str(tmp_path / "full")])
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert "invalid choice" in refusal(capsys, [str(head_dir), "--out", str(tmp_path / "o"), "--format", "trt"])
    assert "--target" in refusal(capsys, [str(head_dir), "--out", str(tmp_path / "o")])  # no run config.yaml
    line = refusal(capsys, [str(head_dir), "--out", str(tmp_path / "o"), "--target", str(tmp_path),
                            "--ngram-model", "auto"])
    assert "--ngram-model" in line and "EAGLE-3" in line
    for bad in ("0", "four", "-3"):
        line = refusal(capsys, [str(head_dir), "--out", str(tmp_path / "o"), "--draft-max-batch", bad])
        assert f"--draft-max-batch {bad}" in line and "'all'" in line
    assert not (tmp_path / "o").exists()


def test_draft_max_batch_writes_vllms_batch_size_schedule(fitted, vllm_target_dir, tmp_path: Path) -> None:
    """--draft-max-batch B: k drafted tokens at 1..B scheduled requests, 0 above (vLLM's dynamic SD
    ranges); 'all' (and 'auto' for an EAGLE-3 head) writes no schedule."""
    head_dir, _ = fitted
    spec = export_head(str(head_dir), tmp_path / "b2", "vllm", target=str(vllm_target_dir),
                       num_speculative_tokens=4, draft_max_batch="2").speculative_config
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 1 << 20, 0]]
    assert json.loads((tmp_path / "b2" / SPEC_CONFIG_FILE).read_text()) == spec
    for value in ("all", "auto"):
        spec = export_head(str(head_dir), tmp_path / value, "vllm", target=str(vllm_target_dir)).speculative_config
        assert "num_speculative_tokens_per_batch_size" not in spec


def our_acceptance(base, head_dir: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[int], int]:
    """Our EAGLE-3 decoding in chain mode (vLLM drafts a chain): outputs, accepted draft tokens per
    position, verification steps."""
    model = DartModel(base, load_eagle3_model(str(head_dir)),
                      tree={"top_k": 1, "depth": SPEC_TOKENS, "total_tokens": SPEC_TOKENS})
    outputs, per_position, steps = [], [0] * SPEC_TOKENS, 0
    for prompt in prompts:
        out, stats = model.dart_generate(torch.tensor([prompt]), max_new_token_num=MAX_NEW, return_stats=True)
        outputs.append(out[0, len(prompt):].tolist())
        steps += len(stats.accept_lengths)
        for accepted in stats.accept_lengths:
            for j in range(accepted):
                per_position[j] += 1
    return outputs, per_position, steps


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_export_losslessly(fitted, vllm_target_dir, tmp_path: Path) -> None:
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.fail(f"no vLLM venv at {VLLM_VENV}: run `make vllm` (make test does)")
    head_dir, prompts = fitted
    export_main([str(head_dir), "--out", str(tmp_path / "export"), "--target", str(vllm_target_dir)])
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    env = {**os.environ, "VLLM_VENV": str(VLLM_VENV), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("OMP_NUM_THREADS", None)  # vLLM sizes its own threads (VLLM_CPU_OMP_THREADS_BIND)
    command = [str(ROOT / "scripts" / "vllm_env.sh"), "python", str(ROOT / "scripts" / "vllm_greedy_check.py"),
               "--target", str(vllm_target_dir), "--speculative-config", str(tmp_path / "export" / SPEC_CONFIG_FILE),
               "--prompts", str(tmp_path / "prompts.json"), "--max-tokens", str(MAX_NEW), "--dtype", "float32",
               "--enforce-eager", "--out", str(tmp_path / "check.json")]
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    check = json.loads((tmp_path / "check.json").read_text())
    # Lossless: vLLM's greedy output with the exported head equals its plain greedy output (fp32) ...
    assert check["spec"] == check["plain"] and check["identical"]
    # ... which equals transformers' greedy on the same target.
    with one_thread():
        ours, per_position, steps = our_acceptance(load_target(vllm_target_dir), head_dir, prompts)
    assert check["plain"] == ours
    # vLLM drafted what we draft: the same number of drafts and accepted tokens per position (the
    # memorised first draft accepted at every step). Wrong aux layers (shifted by one) gave 62/65
    # and a missing norm_before_residual (vLLM's default true) 49/76 when checked by hand.
    metrics = check["metrics"]
    assert metrics["num_drafts"] == steps and metrics["num_accepted_tokens_per_pos"] == per_position
    assert per_position[0] == steps  # the check has teeth: every first draft was accepted


@pytest.mark.vllm
def test_dart_eval_serves_an_eagle3_head_through_vllm(fitted, vllm_target_dir, tmp_path: Path) -> None:
    """dart-eval's `vllm_eagle3`: the head exported for vLLM's EAGLE-3 drafter, fed the same prompt ids,
    lossless (fp32 greedy = transformers) and reporting each step's accepted drafts."""
    from dart_infer.common.errors import InputError
    from dart_infer.engines.vllm.runner import start_engines

    head_dir, prompts = fitted
    with pytest.raises(InputError, match="needs eagle3_model"):
        start_engines(["vllm", "vllm_eagle3"], vllm_target_dir, "float32", tmp_path)
    engines = start_engines(["vllm_eagle3"], vllm_target_dir, "float32", tmp_path, eagle3_model=str(head_dir),
                            eagle3_tokens=SPEC_TOKENS, enforce_eager=True)
    with engines["vllm_eagle3"] as engine:
        runs = [engine.generate(prompt, MAX_NEW) for prompt in prompts]
    with one_thread():
        ours, _, _ = our_acceptance(load_target(vllm_target_dir), head_dir, prompts)
    assert [tokens for tokens, _, _ in runs] == ours
    for tokens, seconds, accepts in runs:
        assert seconds > 0 and accepts is not None and max(accepts) <= SPEC_TOKENS
        assert sum(accepts) + len(accepts) >= len(tokens)  # every token came from a counted step
    assert sum(sum(accepts) for _, _, accepts in runs) > 0  # the memorised head's drafts were accepted
