"""`dart-app`: the web page (configs/app.yaml) — chat with DART, plain decoding and EAGLE-3 on one base
model, and one prompt through two methods side by side.

What cannot be loaded does not stop the page: it says so at the top and offers what is left. No head
(or a head that fails to load) leaves plain decoding only; no trie (or one that does not fit the
tokenizer) runs DART without one; an EAGLE-3 head that cannot be served is named with the reason.
A `host:port` the page cannot be served on (a port in use, ...) is refused before the models load.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dart_infer.cli import hydra_app
from dart_infer.common.dtypes import as_dtype, default_device, resolve_dtype_name
from dart_infer.common.errors import InputError
from dart_infer.target.bf16_weights import resolve_bf16_weights

log = logging.getLogger(__name__)


def load_model(cfg: DictConfig, dtype: str, bf16_weights: bool = False) -> tuple[Any, bool, list[str]]:
    """(DartModel, whether it has a head, notices for the page). Without a head (none given, or one that
    cannot be loaded or does not fit the base model) the model has none and decodes plainly.
    `bf16_weights`: float32 served with the weights rounded to bf16 (`dart_infer.target.bf16_weights`)."""
    from transformers import AutoModelForCausalLM

    from dart_infer.common.dtypes import as_dtype, cast_parameters
    from dart_infer.data.assets import resolve_model
    from dart_infer.data.loaders import load_tokenizer
    from dart_infer.decoding.dart_model import DartModel
    from dart_infer.methods import load_head

    notices: list[str] = []
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    head = None
    if cfg.draft_model in (None, "", "none", "null"):
        notices.append("No DART head given (draft_model=null): DART is off, plain decoding only. "
                       "Start with `dart-app draft_model=<head directory>` (config.json + model.safetensors).")
    else:
        try:
            head, _ = load_head(str(cfg.draft_model))
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
    if head is not None:
        head = cast_parameters(head.to(base.device), base.get_input_embeddings().weight.dtype)
    try:
        model = DartModel(base, head, tokenizer, None, tree=tree if head is not None else None)
    except (ValueError, TypeError) as err:  # a head for another target, or tree settings of another method
        if head is None:
            raise
        notices.append(f"The DART head draft_model={cfg.draft_model} does not fit {cfg.model.name_or_path} "
                       f"({err}); DART is off, plain decoding only.")
        model = DartModel(base, None, tokenizer)
    if bf16_weights:
        model.use_bf16_weights()
    has_head = model.draft_model is not None
    if has_head and model.method.uses_trie:
        trie, note = load_trie(cfg, model)
        model.trie = trie
        if note:
            notices.append(note)
    if has_head:
        model.tree  # noqa: B018  tree=auto fits its size now (seconds, once per machine), not inside a request
    return model.eval(), has_head, notices


def load_trie(cfg: DictConfig, model: Any) -> tuple[Any, str | None]:
    """(trie or None, a notice or None), resolved as `dart-eval` does (`dart_infer.data.resolve`); a trie that
    is missing, corrupt or does not fit is said on the page instead of stopping it (DART then runs
    without one, as the README says for dart-app)."""
    from dart_infer.data.resolve import trie_from_config

    try:
        choice = trie_from_config(cfg, (model.tokenizer, model.target.vocab_size))
    except (InputError, OSError) as err:  # an explicit trie: the message names the key or the file
        return None, f"{err}; DART runs without a trie."
    if choice.trie is None and choice.notice:
        return None, f"{choice.notice}."
    return choice.trie, None


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
    bf16_weights = resolve_bf16_weights(cfg.bf16_weights, cfg.serve_dtype, as_dtype(dtype), default_device())
    model, _, notices = load_model(cfg, dtype, bf16_weights)
    eagle3 = None
    if cfg.eagle3_model:
        try:
            eagle3 = load_eagle3_stream(model, str(cfg.eagle3_model), int(cfg.max_length))
        except Exception as err:  # the page names the reason; the other methods still serve
            notices.append(f"EAGLE-3 is off: {err}")
    if dtype != "float32":
        notices.append(f"Serving in {dtype} (fast mode): answers may differ from float32 plain decoding "
                       "after a while; serve_dtype=float32 is the exactness mode.")
    elif bf16_weights:
        notices.append("Serving float32 with the weights rounded to bf16 (fast mode on a CPU without bf16 "
                       "arithmetic): answers may differ from the checkpoint's float32 plain decoding after a "
                       "while; serve_dtype=float32 is the exactness mode.")
    engine = Engine(model, eagle3=eagle3, notices=notices, max_length=int(cfg.max_length),
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


def check_port_free(host: str, port: int) -> None:
    """Refuse, before the models load, a `host:port` the page could not be served on: a port in use
    (another dart-app, say), an address not of this machine, a port this user may not listen on.

    It binds as the server will (uvicorn: SO_REUSEADDR, so a port a previous run left in TIME_WAIT
    passes) and, like Gradio's own check before it, on 127.0.0.1 as well; the socket is closed at once.
    """
    if not 1 <= port <= 65535:
        raise InputError(f"port={port}: must be in [1, 65535]; pass port=<a free port>, e.g. port=7860")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1] as in a URL
    for address in dict.fromkeys([bare, "127.0.0.1"]):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        shown = f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((address, port))
        except socket.gaierror as err:
            raise InputError(f"host={host}: not an address or a name of this machine ({err.strerror}); pass "
                             "host=127.0.0.1 (this machine only) or host=0.0.0.0 (every interface)") from None
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise InputError(f"port={port}: {shown} is already in use; pass port=<a free port>") from None
            if err.errno == errno.EACCES:
                raise InputError(f"port={port}: this user may not listen on {shown} (ports below 1024 "
                                 "need privileges); pass port=<a free port of 1024 or more>") from None
            if err.errno == errno.EADDRNOTAVAIL:
                raise InputError(f"host={host}: {address} is not an address of this machine; pass "
                                 "host=127.0.0.1 (this machine only) or host=0.0.0.0 (every interface)") from None
            raise InputError(f"port={port}: cannot listen on {shown} ({err.strerror or err}); "
                             "pass another port= or host=") from None


@hydra_app("app")
def _app(cfg: DictConfig) -> None:
    check_port_free(str(cfg.host), int(cfg.port))  # before anything slow: the models load next
    launch(build_engine(cfg), cfg)


def main() -> None:
    """The `dart-app` console script: `tree=<fit_tree.yaml or its run dir>` becomes that tree's settings
    (as in `dart-eval`)."""
    from dart_infer.cli.tree_files import tree_file_overrides

    sys.argv[1:] = tree_file_overrides(sys.argv[1:])
    _app()
