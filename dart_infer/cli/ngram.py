"""`dart-ngram`: build n-gram tries from configured corpora, convert formats, inspect tries.

The app around `ngram_builder`: it resolves the model, loads its tokenizer, reads conversations
(`dart_infer.data.conversations`) and hands the library text sources, a function from text to token ids,
and the tokenizer's fingerprint string. `ngram_builder` itself knows no model and no conversation
format.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dart_infer.cli import hydra_app
from dart_infer.data.assets import tokenizer_fingerprint
from ngram_builder import NgramTrie
from ngram_builder.build import (
    CorpusSource,
    build_tries,
    hf_dataset_texts,
    jsonl_texts,
    source_tree_texts,
    text_file_texts,
)

log = logging.getLogger(__name__)

SOURCE_KINDS = ("conversations", "jsonl", "text", "tree", "hf")


def load_tokenizer(cfg: DictConfig) -> Any:
    """The model's tokenizer with `model.chat_template` (the one training and serving render with)."""
    from dart_infer.data.loaders import load_tokenizer as load

    tok = load(cfg.model.name_or_path, cfg.model.get("chat_template"))
    if not getattr(tok, "is_fast", False):
        log.warning("tokenizer is not a fast tokenizer: tokenization will be slow")
    return tok


def _conversation_texts(spec: dict[str, Any], mode: str, tokenizer: Any):
    from dart_infer.data.conversations import load_conversations

    if mode not in ("join", "chat_template"):
        raise ValueError(f"conversation_text must be 'join' or 'chat_template', got {mode!r}")
    if mode == "chat_template" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"conversation_text=chat_template: the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no "
            "chat template; set model.chat_template=gemma-turns|plain|<file.jinja> (as for training and serving)"
        )
    for conv in load_conversations(spec["source"], split=spec.get("split"), limit=spec.get("limit")):
        if mode == "join":
            yield "\n".join(m["content"] for m in conv.messages)
        else:
            yield tokenizer.apply_chat_template(conv.messages, tokenize=False)


def make_sources(cfg: DictConfig, tokenizer: Any) -> list[CorpusSource]:
    """`cfg.ngram.sources` -> CorpusSource list (lazy: nothing is read until the build iterates)."""
    specs = OmegaConf.to_container(cfg.ngram.sources, resolve=True)
    if not isinstance(specs, list) or not specs:
        raise ValueError("ngram.sources must be a non-empty list")
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or "kind" not in spec:
            raise ValueError(f"ngram.sources[{i}] needs a 'kind' (one of {SOURCE_KINDS})")
        kind = spec["kind"]
        if kind == "conversations":
            texts = functools.partial(_conversation_texts, spec, cfg.conversation_text, tokenizer)
            label = f"conversations:{spec['source']}"
        elif kind == "jsonl":
            texts = functools.partial(jsonl_texts, spec["path"], spec.get("text_field", "text"),
                                      skip_malformed=bool(spec.get("skip_malformed", False)))
            label = f"jsonl:{spec['path']}"
        elif kind == "text":
            texts = functools.partial(text_file_texts, spec["path"], split=spec.get("split", "file"))
            label = f"text:{spec['path']}"
        elif kind == "tree":
            texts = functools.partial(source_tree_texts, spec["root"], spec.get("include", ["*.py"]),
                                      int(spec.get("max_file_bytes", 1 << 20)))
            label = f"tree:{spec['root']}"
        elif kind == "hf":
            texts = functools.partial(hf_dataset_texts, spec["name"], config=spec.get("config"),
                                      split=spec.get("split", "train"), text_field=spec.get("text_field", "text"),
                                      streaming=bool(spec.get("streaming", True)))
            label = f"hf:{spec['name']}"
        else:
            raise ValueError(f"ngram.sources[{i}]: unknown kind {kind!r} (one of {SOURCE_KINDS})")
        out.append(CorpusSource(name=spec.get("name", label), texts=texts, weight=float(spec.get("weight", 1.0)),
                                max_docs=spec.get("max_docs")))
    return out


def run_build(cfg: DictConfig) -> dict[str, Any]:
    tokenizer = load_tokenizer(cfg)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token (appended to every document, as in DART)")

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    report = build_tries(
        make_sources(cfg, tokenizer), encode, cfg.out_dir, vocab_size=len(tokenizer),
        eos_id=int(tokenizer.eos_token_id), order=int(cfg.order), min_count=int(cfg.min_count),
        fingerprint=tokenizer_fingerprint(tokenizer), memory_cap_mb=float(cfg.memory_cap_mb),
        threads=int(cfg.threads), batch_docs=int(cfg.batch_docs), write_dart=bool(cfg.write_dart),
        overwrite=bool(cfg.overwrite), seed=int(cfg.seed), progress=bool(cfg.progress),
    )
    print(report.summary(), flush=True)
    return {"report": report}


def run_convert(cfg: DictConfig) -> dict[str, Any]:
    if not cfg.input or not cfg.output:
        raise ValueError("convert needs input=<trie file> and output=<path> (*.trie: original format)")
    trie = NgramTrie.open(cfg.input, verify=bool(cfg.verify),
                          vocab_size=int(cfg.vocab_size) if cfg.vocab_size else None)
    if cfg.fingerprint is not None:
        trie.tokenizer_fingerprint = str(cfg.fingerprint)
    out = Path(cfg.output)
    if out.suffix == ".trie":
        trie.save_dart(out, overwrite=bool(cfg.overwrite))
    else:
        trie.save(out, overwrite=bool(cfg.overwrite))
    print(f"wrote {out} ({out.stat().st_size:,} bytes, {trie.num_nodes:,} nodes, "
          f"{out.stat().st_size / trie.num_nodes:.2f} bytes/node)", flush=True)
    return {"trie": trie}


def run_inspect(cfg: DictConfig) -> dict[str, Any]:
    if not cfg.input:
        raise ValueError("inspect needs input=<trie file>")
    trie = NgramTrie.open(cfg.input, verify=bool(cfg.verify))
    info = trie.info()
    print(f"{cfg.input}:")
    for key, value in info.items():
        if key != "levels":
            print(f"  {key}: {value}")
    for k, level in enumerate(info["levels"], 1):
        print(f"  level {k}: {level}")
    print(f"  bytes/node: {info['file_bytes'] / info['num_nodes']:.2f} (file), "
          f"{info['ram_bytes'] / info['num_nodes']:.2f} (RAM)")
    tokenizer = None
    if cfg.context_text is not None or cfg.decode:
        try:
            tokenizer = load_tokenizer(cfg)
        except Exception as e:  # decoding is a convenience; ids are still printed
            if cfg.context_text is not None:
                raise
            log.warning("cannot load the tokenizer to decode tokens (%s)", e)
    if tokenizer is not None:
        fp = tokenizer_fingerprint(tokenizer)
        if trie.tokenizer_fingerprint and trie.tokenizer_fingerprint != fp:
            print(f"  WARNING: trie fingerprint {trie.tokenizer_fingerprint} != model tokenizer {fp}")
    context = list(cfg.context)
    if cfg.context_text is not None:
        context = tokenizer(str(cfg.context_text), add_special_tokens=False)["input_ids"]
    context = context[-(trie.order - 1):] if trie.order > 1 else []
    top = trie.top_continuations(context, int(cfg.top_k))
    shown = [tokenizer.decode([t]) for t in context] if tokenizer is not None else context
    print(f"top {len(top)} continuations of {shown} (ids {context}):")
    for tok, count, p in top:
        text = f" {tokenizer.decode([tok])!r}" if tokenizer is not None else ""
        print(f"  {tok:>8}{text}  count {count:,}  p {p:.4f}")
    return {"trie": trie, "top": top}


ACTIONS = {"build": run_build, "convert": run_convert, "inspect": run_inspect}


def run(cfg: DictConfig) -> dict[str, Any]:
    """Dispatch `cfg.action` (separate from `main` so tests can call it with a composed config)."""
    if cfg.action not in ACTIONS:
        raise ValueError(f"unknown action {cfg.action!r}; use one of {sorted(ACTIONS)}")
    return ACTIONS[cfg.action](cfg)


def main() -> None:
    hydra_app("ngram")(run)()


if __name__ == "__main__":
    main()
