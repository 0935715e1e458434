"""Loading and pairing the pieces of a DART model: tokenizer and chat template, head and trie files,
compatibility checks, EOS ids.

Serving (`DartModel`, `dart-app`, `dart-eval`), `dart-ngram` and training (`dart-train`,
`dart_train.data.regenerate`) load and check through these functions, so a tokenizer, chat template, head,
trie or EOS set means the same thing on every side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "check_trie_matches_tokenizer",
    "eos_token_ids",
    "load_tokenizer",
    "load_trie",
]


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list | tuple) else [value])]


def eos_token_ids(base_model: Any, tokenizer: Any = None) -> tuple[int, ...]:
    """Every token that ends a generation: the generation config's EOS ids (the model config's
    when the model has no generation config), then the tokenizer's EOS if it is not among them.

    The union matters for chat checkpoints whose two sources disagree. Llama-3-Instruct lists
    several ids in generation_config.json (3.1: [128001, 128008, 128009]) and names <|eot_id|>
    (128009) as the tokenizer's EOS; a checkpoint whose generation config holds only the base
    model's 128001 (<|end_of_text|>), as fine-tunes saved from the base config do, still ends every
    answer with 128009, and stopping at the generation config's ids alone would run past the end
    of the turn. The generation config's ids come first: the first id is the one the tree search
    ranks last (it takes a single id). A generation config whose EOS is None and no tokenizer give
    () (no EOS stop).
    """
    generation_config = getattr(base_model, "generation_config", None)
    if generation_config is not None:
        ids = _ids(generation_config.eos_token_id)
    else:
        ids = _ids(getattr(base_model.config, "eos_token_id", None))
    if tokenizer is not None:
        ids += [i for i in _ids(tokenizer.eos_token_id) if i not in ids]
    return tuple(dict.fromkeys(ids))


def load_tokenizer(name_or_path: str | Path, chat_template: str | None = None) -> Any:
    """The target's tokenizer, with `chat_template` (see `resolve_chat_template`) replacing its own.

    Every tool loads the target's tokenizer here, so training (which renders conversations and their
    loss mask with the chat template), regeneration, tries and serving render conversations the same
    way; `chat_template` gives base models without a template one (`model.chat_template` in the
    configs; None or "" keeps the tokenizer's own). Embedded names resolve through
    `dart_infer.data.assets.resolve_model`.
    """
    from transformers import AutoTokenizer

    from dart_infer.data.assets import resolve_model
    from dart_infer.data.chat_templates import resolve_chat_template

    template = resolve_chat_template(chat_template) if chat_template else None  # bad settings fail first
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path))
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def check_trie_matches_tokenizer(trie: Any, tokenizer: Any, vocab_size: int) -> None:
    """Raise `NgramMismatchError` (a ValueError) if the trie was built with another tokenizer
    (stored fingerprint) or holds ids beyond the base model's vocabulary."""
    from dart_infer.data.assets import tokenizer_fingerprint

    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    trie.check_compatible(vocab_size=vocab_size, tokenizer_fingerprint=fingerprint)


def load_trie(path: str | Path, is_small_ngram: bool = False, mmap: bool = True, verify: bool = False) -> Any:
    """An `ngram_builder.NgramTrie` from a file, or from a directory holding full/small tries.

    In a directory (the authors' release layout, or a `dart-ngram` output dir) `is_small_ngram`
    picks small over full, and for the same size the compact `.ngt` wins over the original `.trie`
    (memory-mapped: milliseconds instead of seconds). `mmap=False` reads a compact trie into memory
    with its query index instead (faster queries, see `NgramTrie.load`). Every load checks the
    payload's structure (`ngram_builder.CorruptTrieError`, one line naming the file); `verify=True`
    (the commands' `ngram_verify`) adds the payload checksum.
    """
    from ngram_builder import NgramTrie

    location = Path(path)
    if location.is_dir():
        sizes = ("small", "full") if is_small_ngram else ("full", "small")
        names = [f"{size}.{ext}" for size in sizes for ext in ("ngt", "trie")]
        found = [location / n for n in names if (location / n).is_file()]
        found += sorted(p for p in (*location.glob("*.ngt"), *location.glob("*.trie")) if p not in found)
        if not found:
            raise FileNotFoundError(f"no .ngt or .trie file in {location}")
        location = found[0]
    elif not location.is_file():
        raise FileNotFoundError(f"n-gram trie not found: {location}")
    return NgramTrie.open(location, mmap=mmap, verify=verify)  # either format: the compact one or the original
