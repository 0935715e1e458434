"""`dart-app`: the web page (configs/app.yaml) — chat with DART, plain decoding and EAGLE-3 on one base
model, and one prompt through two methods side by side.

What cannot be loaded does not stop the page: it says so at the top and offers what is left. No head
(or a head that fails to load) leaves plain decoding only; no trie (or one that does not fit the
tokenizer) runs DART without one; an EAGLE-3 head that cannot be served is named with the reason.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dart_infer.cli import hydra_app
from dart_infer.dtypes import resolve_dtype_name

log = logging.getLogger(__name__)


def _placeholder_head(base_model: Any) -> Any:
    """A tiny random head so plain decoding runs through `DartModel` when no head is loaded.
    The engine never offers DART with it (`has_head=False`)."""
    from dart_infer.model import DartDraftConfig, DartDraftModel

    head = DartDraftModel(DartDraftConfig.from_target_config(base_model.config, draft_length=2, draft_vocab_size=16))
    head.set_vocab_mapping(torch.arange(16))
    return head.eval()


def load_model(cfg: DictConfig, dtype: str) -> tuple[Any, bool, list[str]]:
    """(DartModel, whether it has a real head, notices for the page)."""
    from transformers import AutoModelForCausalLM

    from dart_infer.assets import resolve_model
    from dart_infer.dtypes import as_dtype, cast_parameters
    from dart_infer.generate import DartModel
    from dart_infer.loading import load_draft_model, load_tokenizer

    notices: list[str] = []
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    head = None
    if cfg.draft_model in (None, "", "none", "null"):
        notices.append("No DART head given (draft_model=null): DART is off, plain decoding only. "
                       "Start with `dart-app draft_model=<head directory>` (config.json + model.safetensors).")
    else:
        try:
            head = load_draft_model(resolve_model(str(cfg.draft_model)))
        except Exception as err:  # any reason: the page says which and still serves plain decoding
            notices.append(f"The DART head draft_model={cfg.draft_model} could not be loaded ({err}); "
                           "DART is off, plain decoding only.")
    base_path = resolve_model(cfg.model.name_or_path)
    tokenizer = load_tokenizer(base_path, cfg.model.get("chat_template"))  # a bad setting fails first
    if not getattr(tokenizer, "chat_template", None):
        notices.append(f"The tokenizer of {cfg.model.name_or_path} has no chat template, so chats cannot be "
                       "rendered: start with model.chat_template=gemma-turns|plain|<file.jinja> (the one the "
                       "head was trained with).")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=as_dtype(dtype), attn_implementation="sdpa")
    has_head = head is not None
    head = head if has_head else _placeholder_head(base)
    head = cast_parameters(head.to(base.device), base.get_input_embeddings().weight.dtype)
    try:
        model = DartModel(base, head, tokenizer, None, tree=tree)
    except ValueError as err:  # a head for another target
        if not has_head:
            raise
        notices.append(f"The DART head draft_model={cfg.draft_model} does not fit {cfg.model.name_or_path} "
                       f"({err}); DART is off, plain decoding only.")
        has_head = False
        model = DartModel(base, cast_parameters(_placeholder_head(base), head.fc.weight.dtype), tokenizer, None,
                          tree=tree)
    if has_head:
        trie, note = load_trie(cfg, model)
        model.trie = trie
        if note:
            notices.append(note)
    return model.eval(), has_head, notices


def load_trie(cfg: DictConfig, model: Any) -> tuple[Any, str | None]:
    """(trie or None, a notice or None). `ngram_model: auto` takes `default_ngram_model` when it exists
    and fits the tokenizer; a trie that is missing, corrupt or does not fit is said on the page (DART then
    runs without one, as the README says for dart-app)."""
    from dart_infer.assets import resolve_model
    from dart_infer.loading import check_trie_matches_tokenizer
    from dart_infer.loading import load_trie as read_trie
    from ngram_builder import NgramFormatError

    value = cfg.ngram_model
    if value is None or str(value).lower() in ("", "none", "null"):
        return None, None
    auto = str(value) == "auto"
    path = Path(cfg.default_ngram_model if auto else resolve_model(str(value)))
    if not path.exists():
        if auto:
            return None, (f"No n-gram trie at {path} (build it with `dart-ngram`): DART runs without a trie.")
        return None, f"ngram_model={value}: no such trie file or directory; DART runs without a trie."
    try:
        trie = read_trie(path, mmap=bool(cfg.ngram_mmap), verify=bool(cfg.get("ngram_verify", False)))
        check_trie_matches_tokenizer(trie, model.tokenizer, model.target.vocab_size)
    except NgramFormatError as err:  # corrupt or unreadable: the message names the file and how to rebuild it
        return None, f"{err}; DART runs without a trie."
    except (ValueError, OSError) as err:
        return None, f"The trie {path} cannot be used with this model ({err}); DART runs without a trie."
    return trie, None


def build_engine(cfg: DictConfig) -> Any:
    """The engine behind the page: model, methods, notices, the page's default settings."""
    from dart_infer.app.engine import Decoding, Engine, load_eagle3_stream

    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    dtype = resolve_dtype_name(cfg.serve_dtype)
    defaults = Decoding(float(cfg.temperature), float(cfg.top_p), int(cfg.top_k), None,
                        int(cfg.max_new_tokens), int(cfg.seed))
    defaults.check()  # bad defaults fail before the model loads
    torch.manual_seed(int(cfg.seed))
    model, has_head, notices = load_model(cfg, dtype)
    eagle3 = None
    if cfg.eagle3_model:
        try:
            eagle3 = load_eagle3_stream(model, str(cfg.eagle3_model), int(cfg.max_length))
        except Exception as err:  # the page names the reason; the other methods still serve
            notices.append(f"EAGLE-3 is off: {err}")
    if dtype != "float32":
        notices.append(f"Serving in {dtype} (fast mode): answers may differ from float32 plain decoding "
                       "after a while; serve_dtype=float32 is the exactness mode.")
    engine = Engine(model, has_head=has_head, eagle3=eagle3, notices=notices, max_length=int(cfg.max_length),
                    defaults=defaults, update_interval=1.0 / float(cfg.updates_per_second))
    engine.warm_up()
    return engine


def launch(engine: Any, cfg: DictConfig) -> None:
    from dart_infer.app.ui import CSS, build_ui

    demo = build_ui(engine)
    demo.queue(default_concurrency_limit=int(cfg.concurrency))
    print(f"dart-app: methods {engine.method_names}; serving on http://{cfg.host}:{cfg.port}", flush=True)
    demo.launch(server_name=str(cfg.host), server_port=int(cfg.port), css=CSS, ssr_mode=False, share=False,
                show_error=True, inbrowser=False)


@hydra_app("app")
def _app(cfg: DictConfig) -> None:
    launch(build_engine(cfg), cfg)


def main() -> None:
    """The `dart-app` console script: `tree=<fit_tree.yaml or its run dir>` becomes that tree's settings
    (as in `dart-eval`)."""
    from dart_infer.cli.eval import tree_file_overrides

    sys.argv[1:] = tree_file_overrides(sys.argv[1:])
    _app()
