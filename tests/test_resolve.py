"""The one resolver of each setting every entry point shares: a trie setting (`dart_infer.data.resolve`:
auto / null / a path, with real tiny tries and SmolLM2's tokenizer), dtype settings
(`dart_infer.common.dtypes.resolve_dtype`: auto = bf16 where it measures faster, whoever asks), and the trainer settings
read from the structured `optim` / `trainer` / `logging` groups (`dart_train.trainer.settings`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import compose_train
from omegaconf import OmegaConf

from dart_infer.common.dtypes import bf16_is_faster, default_device, resolve_dtype, resolve_dtype_name
from dart_infer.common.errors import InputError
from dart_infer.data.resolve import TrieChoice, resolve_trie, trie_from_config
from ngram_builder import NgramTrie

NATIVE = bf16_is_faster(default_device())
VOCAB = 49152  # SmolLM2's


def _trie(path: Path, fingerprint: str, vocab_size: int = 200) -> Path:
    trie = NgramTrie(order=3, vocab_size=vocab_size)
    for start in range(5, 60, 5):
        trie.add_tokens(list(range(start, start + 12)))
    trie.tokenizer_fingerprint = fingerprint
    path.parent.mkdir(parents=True, exist_ok=True)
    trie.save(path)
    return path


@pytest.fixture(scope="module")
def tries(smollm2_tokenizer, tmp_path_factory) -> dict[str, Path]:
    from dart_infer.data.assets import tokenizer_fingerprint

    root = tmp_path_factory.mktemp("tries")
    corrupt = root / "corrupt" / "full.ngt"
    corrupt.parent.mkdir()
    corrupt.write_bytes(b"not a trie at all" * 8)
    return {
        "fits": _trie(root / "fits" / "full.ngt", tokenizer_fingerprint(smollm2_tokenizer)),
        "other": _trie(root / "other" / "full.ngt", "another-tokenizer"),
        "too_big": _trie(root / "big" / "full.ngt", tokenizer_fingerprint(smollm2_tokenizer), VOCAB + 10),
        "corrupt": corrupt,
    }


# ----------------------------------------------------------------------------------------- tries


def test_no_trie_needs_no_model(tmp_path: Path) -> None:
    def never() -> tuple:
        raise AssertionError("no trie to check: the model's vocabulary is not needed")

    for value in (None, "", "none", "null", "None"):
        assert resolve_trie(value, vocabulary=never, default=tmp_path / "x.ngt") == TrieChoice(None, None, None)
    # auto without a built default: said in one line, nothing loaded.
    choice = resolve_trie("auto", vocabulary=never, default=tmp_path / "x.ngt")
    assert choice.trie is None and choice.path is None
    assert choice.notice == (f"ngram_model=auto: the default trie {tmp_path / 'x.ngt'} does not exist (build it "
                             "with `dart-ngram`); DART runs without a trie")
    assert "no default trie" in resolve_trie("auto", vocabulary=never, key="train_eval.ngram_model").notice


def test_auto_takes_the_default_only_when_it_fits(smollm2_tokenizer, tries) -> None:
    model = (smollm2_tokenizer, VOCAB)
    used = resolve_trie("auto", vocabulary=lambda: model, default=tries["fits"])
    assert isinstance(used.trie, NgramTrie) and used.path == str(tries["fits"])
    assert used.notice == f"ngram_model=auto: using the default trie {tries['fits']}"
    assert used.trie.probability([5, 6], [7])[0] == [1.0]  # the trie that was built
    for name in ("other", "too_big"):
        choice = resolve_trie("auto", vocabulary=model, default=tries[name])
        assert choice.trie is None and choice.path is None
        assert choice.notice.startswith(f"ngram_model=auto: the default trie {tries[name]} does not fit this model (")
        assert choice.notice.endswith("; DART runs without a trie")
    corrupt = resolve_trie("auto", vocabulary=model, default=tries["corrupt"])
    assert corrupt.trie is None and corrupt.notice.startswith("ngram_model=auto: ")  # the loader's line, naming
    assert str(tries["corrupt"]) in corrupt.notice  # the file
    assert corrupt.notice.endswith("; DART runs without a trie") and "\n" not in corrupt.notice


def test_an_explicit_trie_must_exist_load_and_fit(smollm2_tokenizer, tries, tmp_path: Path) -> None:
    model = (smollm2_tokenizer, VOCAB)
    given = resolve_trie(str(tries["fits"].parent), vocabulary=model)  # a dart-ngram output directory works too
    assert isinstance(given.trie, NgramTrie) and given.path == str(tries["fits"].parent) and given.notice is None
    with pytest.raises(FileNotFoundError, match=f"^ngram_model={tmp_path / 'gone.ngt'}: no such trie file"):
        resolve_trie(str(tmp_path / "gone.ngt"), vocabulary=model)
    with pytest.raises(InputError, match=f"^--trie={tries['other']}: the trie does not fit this model .*tokenizer"):
        resolve_trie(str(tries["other"]), vocabulary=model, key="--trie")
    with pytest.raises(InputError, match="beyond the model's vocabulary"):
        resolve_trie(str(tries["too_big"]), vocabulary=model)
    with pytest.raises(InputError, match=str(tries["corrupt"])):
        resolve_trie(str(tries["corrupt"]), vocabulary=model)


def test_config_nodes_resolve_with_their_own_keys(smollm2_tokenizer, tries) -> None:
    model = (smollm2_tokenizer, VOCAB)
    app = OmegaConf.create({"ngram_model": "auto", "default_ngram_model": str(tries["fits"]), "ngram_mmap": False,
                            "ngram_verify": True})
    assert trie_from_config(app, model).path == str(tries["fits"])
    train_eval = compose_train(f"train_eval.ngram_model={tries['other']}").train_eval
    with pytest.raises(InputError, match=r"^train_eval\.ngram_model=.*does not fit this model"):
        trie_from_config(train_eval, model, prefix="train_eval.")
    assert trie_from_config(compose_train().train_eval, model, prefix="train_eval.").trie is None  # null default


# ---------------------------------------------------------------------------------------- dtypes


def test_auto_dtype_is_bf16_where_native_for_every_caller() -> None:
    from dart_train.builders import settings_from_config, states_target_dtype

    assert resolve_dtype("auto") == (torch.bfloat16 if NATIVE else torch.float32)
    assert resolve_dtype("auto", otherwise=None) == (torch.bfloat16 if NATIVE else None)
    assert resolve_dtype_name("auto") == ("bfloat16" if NATIVE else "float32")
    assert resolve_dtype(None) is None and resolve_dtype("null") is None and resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype_name("fp32") == "float32"
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype_name("none")
    # Training asks the same resolver: the head's autocast and the target's states dtype.
    assert settings_from_config(compose_train("trainer.autocast=auto")).autocast_dtype == (
        "bfloat16" if NATIVE else None)
    assert settings_from_config(compose_train("trainer.autocast=null")).autocast_dtype is None
    fp32 = compose_train("states.target_dtype=auto", "model.dtype=float32")
    assert states_target_dtype(fp32) == (torch.bfloat16 if NATIVE else torch.float32)
    assert states_target_dtype(compose_train("states.target_dtype=float32")) == torch.float32


# ------------------------------------------------------------------------------ trainer settings


@pytest.mark.parametrize("trainer", ["cpu", "gpu", "zero2", "zero3"])
def test_the_groups_keys_are_their_structured_configs_fields(trainer: str) -> None:
    from dart_train.trainer.settings import LoggingConfig, OptimConfig, TrainerConfig

    cfg = compose_train(f"trainer={trainer}")
    for group, cls in (("trainer", TrainerConfig), ("optim", OptimConfig), ("logging", LoggingConfig)):
        assert set(cfg[group]) == {f.name for f in dataclasses.fields(cls)}, group


def test_settings_take_every_key_by_its_name() -> None:
    from dart_train.builders import settings_from_config
    from dart_train.trainer.settings import CONFIG_KEYS, EngineConfig, OptimConfig, TrainSettings, from_group

    cfg = compose_train("trainer=zero3", "optim.lr=3e-4", "optim.betas=[0.8,0.95]", "trainer.max_steps=7",
                        "trainer.save_every=0", "logging.log_every=3", "train_eval.every=5", "seed=4")
    settings = settings_from_config(cfg)
    for f in (*dataclasses.fields(OptimConfig), *dataclasses.fields(EngineConfig)):
        expected = OmegaConf.select(cfg, CONFIG_KEYS[f.name])
        if f.name == "save_every":
            expected = None  # 0: only at the end, as null
        got = getattr(settings, f.name)
        assert (list(got) if isinstance(got, tuple) else got) == expected, f.name
    assert (settings.lr, settings.betas, settings.log_every, settings.eval_every, settings.seed) == (
        3e-4, (0.8, 0.95), 3, 5, 4)
    assert settings_from_config(compose_train("train_eval=off")).eval_every is None
    # Every field's message names a key the config has (resume messages use them).
    for f in dataclasses.fields(TrainSettings):
        if f.name != "extra_ds_config":
            assert OmegaConf.select(cfg, CONFIG_KEYS[f.name], default="absent") != "absent", f.name
    # The loss weight base: draft.gamma (EAGLE-3's 0.8) overrides optim.gamma (DART's 0.6).
    assert settings.gamma == 0.6 and settings_from_config(compose_train("draft=eagle3")).gamma == 0.8
    # A key without a field is refused, not ignored.
    with pytest.raises(Exception, match="max_stepz"):
        from_group(EngineConfig, {"max_stepz": 2})
    with pytest.raises(ValueError, match="zero_stage"):
        settings_from_config(compose_train("trainer.zero_stage=5"))
