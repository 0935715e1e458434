"""The one resolver of a trie setting (`ngram_model`, `train_eval.ngram_model`, a bench's `--trie`):
`dart-eval`, `dart-app`, `dart-train`'s held-out evaluation and the benches decide the same way.

    null / none      no trie
    auto             the default trie (`default_ngram_model`, what `dart-ngram` builds) when it exists,
                     loads and was built with the model's tokenizer; else no trie, said in one line
    a file or dir    that trie; missing, corrupt (`ngram_verify` adds the payload checksum) or built
                     with another tokenizer: an error naming the key, before any model loads

Dtype settings have theirs in `dart_infer.common.dtypes.resolve_dtype`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dart_infer.common.errors import InputError

__all__ = ["TrieChoice", "default_trie_path", "model_vocabulary", "resolve_trie", "trie_from_config"]

NO_TRIE = ("", "none", "null")

# (tokenizer, vocabulary size) of the model the trie is for, or a function giving them only when a
# trie is there to check (`dart-eval` decides before its model loads).
Vocabulary = tuple[Any, int] | Callable[[], tuple[Any, int]]


@dataclass(frozen=True)
class TrieChoice:
    """What a trie setting resolved to: the loaded trie (None: DART runs without one), the file or
    directory it came from, and one line to tell the user (what `auto` chose, or why there is none)."""

    trie: Any | None
    path: str | None
    notice: str | None


def model_vocabulary(name_or_path: str, chat_template: str | None = None) -> tuple[Any, int]:
    """(tokenizer, vocabulary size) of a target, from its tokenizer and config: no weights load."""
    from transformers import AutoConfig

    from dart_infer.data.assets import resolve_model
    from dart_infer.data.loaders import load_tokenizer

    path = resolve_model(name_or_path)
    vocab = AutoConfig.from_pretrained(path).get_text_config(decoder=True).vocab_size
    return load_tokenizer(path, chat_template), int(vocab)


def default_trie_path() -> str:
    """The trie `ngram_model: auto` takes in `dart-eval` and `dart-app` (their `default_ngram_model`:
    what `dart-ngram` builds by default), for callers without a command's config (the benches)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dart_infer.common.configs import configs_dir

    if GlobalHydra.instance().is_initialized():  # inside a Hydra job
        return str(compose(config_name="eval").default_ngram_model)
    with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
        return str(compose(config_name="eval").default_ngram_model)


def _check_fits(trie: Any, vocabulary: Vocabulary) -> None:
    """`NgramMismatchError` when `trie` was built with another tokenizer than the model's."""
    from dart_infer.data.loaders import check_trie_matches_tokenizer

    tokenizer, vocab_size = vocabulary() if callable(vocabulary) else vocabulary
    check_trie_matches_tokenizer(trie, tokenizer, int(vocab_size))


def resolve_trie(
    value: str | Path | None,
    *,
    vocabulary: Vocabulary,
    default: str | Path | None = None,
    mmap: bool = True,
    verify: bool = False,
    key: str = "ngram_model",
) -> TrieChoice:
    """Resolve a trie setting (module doc). `vocabulary`: the model's tokenizer and vocabulary size
    the trie must fit; `default`: the trie `auto` takes; `key`: the setting's name in messages.

    Raises `FileNotFoundError` / `InputError` for an explicit trie that is missing, corrupt or does
    not fit; `auto` never raises for the default trie, it says why DART runs without one."""
    from dart_infer.data.loaders import load_trie
    from ngram_builder import NgramFormatError, NgramMismatchError

    if value is None or str(value).lower() in NO_TRIE:
        return TrieChoice(None, None, None)
    if str(value) != "auto":
        path = Path(str(value))
        if not path.exists():
            raise FileNotFoundError(f"{key}={value}: no such trie file or directory")
        try:
            trie = load_trie(path, mmap=mmap, verify=verify)
        except NgramFormatError as err:  # corrupt or unreadable: the message names the file and the fix
            raise InputError(str(err)) from err
        try:
            _check_fits(trie, vocabulary)
        except NgramMismatchError as err:
            raise InputError(f"{key}={value}: the trie does not fit this model ({err})") from err
        return TrieChoice(trie, str(value), None)
    without = "DART runs without a trie"
    if default is None:
        return TrieChoice(None, None, f"{key}=auto: no default trie is configured here; {without}")
    default = Path(str(default))
    if not default.exists():
        return TrieChoice(None, None, f"{key}=auto: the default trie {default} does not exist (build it with "
                                      f"`dart-ngram`); {without}")
    try:
        trie = load_trie(default, mmap=mmap, verify=verify)
    except (NgramFormatError, OSError) as err:  # corrupt or unreadable: the message names the file
        return TrieChoice(None, None, f"{key}=auto: {err}; {without}")
    try:
        _check_fits(trie, vocabulary)
    except NgramMismatchError as err:
        return TrieChoice(None, None, f"{key}=auto: the default trie {default} does not fit this model ({err}); "
                                      f"{without}")
    return TrieChoice(trie, str(default), f"{key}=auto: using the default trie {default}")


def trie_from_config(node: Mapping[str, Any], vocabulary: Vocabulary, prefix: str = "", mmap: bool | None = None) -> TrieChoice:
    """`resolve_trie` of a config node's `ngram_model`, with its `default_ngram_model`, `ngram_mmap`
    and `ngram_verify` where it has them; `prefix`: the node's key (e.g. "train_eval.") for messages;
    `mmap`: overrides `ngram_mmap` (a check whose trie is loaded again later maps it)."""
    return resolve_trie(
        node.get("ngram_model"), vocabulary=vocabulary, default=node.get("default_ngram_model"),
        mmap=bool(node.get("ngram_mmap", True)) if mmap is None else mmap,
        verify=bool(node.get("ngram_verify", False)), key=f"{prefix}ngram_model",
    )
