"""Loading and pairing the pieces of a DART model: tokenizer and chat template, head and trie files,
compatibility checks, EOS ids.

Serving (`DartModel`, `dart-app`, `dart-eval`), `dart-ngram` and training (`dart-train`,
`dart_train.regenerate`) load and check through these functions, so a tokenizer, chat template, head,
trie or EOS set means the same thing on every side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dart_infer.model import DartDraftModel
from dart_infer.target import TargetModel

__all__ = [
    "BUILTIN_CHAT_TEMPLATES",
    "builtin_chat_template",
    "check_head_matches_target",
    "check_trie_matches_tokenizer",
    "eos_token_ids",
    "load_draft_model",
    "load_tokenizer",
    "load_trie",
    "resolve_chat_template",
]

# Chat templates shipped in dart_infer/templates/<name>.jinja (their header comments say exactly
# what they render): for base models whose tokenizer has no chat template.
TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
BUILTIN_CHAT_TEMPLATES = ("gemma-turns", "plain")


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


def builtin_chat_template(name: str) -> str:
    """The Jinja source of a built-in chat template (`BUILTIN_CHAT_TEMPLATES`), e.g. to write into a
    converted checkpoint's tokenizer."""
    if name not in BUILTIN_CHAT_TEMPLATES:
        raise ValueError(f"no built-in chat template named {name!r}; built-ins: {', '.join(BUILTIN_CHAT_TEMPLATES)}")
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def resolve_chat_template(spec: str) -> str:
    """The Jinja source a `chat_template` setting names: a built-in name, a `.jinja` file's contents,
    or the setting itself when it is a Jinja string (holds `{%` or `{{`)."""
    spec = str(spec)
    if spec in BUILTIN_CHAT_TEMPLATES:
        return builtin_chat_template(spec)
    if "{%" in spec or "{{" in spec:
        return spec
    path = Path(spec).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a name too long to be a path
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    where = f"no such file {str(path.resolve())!r}" if spec.endswith(".jinja") else "not a built-in name"
    raise ValueError(
        f"chat_template={spec!r}: {where}. Give a built-in ({', '.join(BUILTIN_CHAT_TEMPLATES)}), "
        "the path of a .jinja file, or a Jinja string."
    )


def load_tokenizer(name_or_path: str | Path, chat_template: str | None = None) -> Any:
    """The target's tokenizer, with `chat_template` (see `resolve_chat_template`) replacing its own.

    Every tool loads the target's tokenizer here, so training (which renders conversations and their
    loss mask with the chat template), regeneration, tries and serving render conversations the same
    way; `chat_template` gives base models without a template one (`model.chat_template` in the
    configs; None or "" keeps the tokenizer's own). Embedded names resolve through
    `dart_infer.assets.resolve_model`.
    """
    from transformers import AutoTokenizer

    from dart_infer.assets import resolve_model

    template = resolve_chat_template(chat_template) if chat_template else None  # bad settings fail first
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path))
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def check_head_matches_target(draft: Any, target: TargetModel, kind: str = "DART") -> None:
    """Raise a ValueError naming every mismatch between a head (of any draft method; `kind` names it
    in the message) and the base model it is paired with."""
    cfg = draft.config
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != base hidden_size {target.hidden_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(
            f"target_hidden_size {cfg.target_hidden_size} != base hidden_size {target.hidden_size}"
        )
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != base vocab_size {target.vocab_size}")
    if draft.fc.in_features != 3 * target.hidden_size:
        problems.append(f"fc takes {draft.fc.in_features} inputs, base gives 3 x {target.hidden_size}")
    if problems:
        raise ValueError(f"the {kind} head does not fit the base model: " + "; ".join(problems))


def check_trie_matches_tokenizer(trie: Any, tokenizer: Any, vocab_size: int) -> None:
    """Raise `NgramMismatchError` (a ValueError) if the trie was built with another tokenizer
    (stored fingerprint) or holds ids beyond the base model's vocabulary."""
    from dart_infer.assets import tokenizer_fingerprint

    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    trie.check_compatible(vocab_size=vocab_size, tokenizer_fingerprint=fingerprint)


def load_draft_model(
    path: str | Path, *, dtype: torch.dtype | None = None, model_class: Any = DartDraftModel, kind: str = "DART"
) -> Any:
    """Load a head saved by us or by the authors; any missing, unreadable or mis-shaped tensor is an error.
    `model_class`/`kind`: another method's head class and its name in messages (`DraftMethod.load`;
    `dart_infer.methods.load_head` finds the method from the head's config)."""
    from dart_infer.assets import check_model_reference, resolve_model

    check_model_reference(str(path), f"{kind} head", head=True)  # a typo fails here, not on the network
    source = resolve_model(path)
    local = Path(source)
    if local.exists():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{kind} head directory {local} has no config.json")
        if not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
            raise FileNotFoundError(f"{kind} head directory {local} has no weights (model.safetensors)")
    try:
        model, info = model_class.from_pretrained(source, output_loading_info=True, dtype=dtype)
    except Exception as err:  # transformers/safetensors raise many types for a bad checkpoint
        raise ValueError(f"cannot load the {kind} head from '{source}': {err}") from err
    missing = list(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if missing or mismatched:
        raise ValueError(f"incomplete {kind} head at '{source}': missing {missing}, mismatched {mismatched}")
    return model


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
