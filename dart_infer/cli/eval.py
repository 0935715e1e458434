"""`dart-eval`: τ and wall-clock speedup on benchmarks, and tree sizing for this machine (configs/eval.yaml).

- Serving dtype `model.dtype` (DART and every method), plus the plain methods in `baseline_dtypes`: the
  target is loaded once, in float32 when more than one dtype is timed, and cast (what loading in
  that dtype gives).
- `ngram_model: auto` takes the default trie (`default_ngram_model`) when it exists and fits the
  tokenizer and loads, else DART runs without a trie (said once); an explicit path must exist and load.
- `action=fit_tree` writes `<out_dir>/fit_tree.yaml` (the best tree, the dtype and machine it was
  measured on, every setting's numbers); `tree=<that file>` (or its directory) evaluates with it.
- Nothing measured is lost: bad input (out_dir, limit, max_new_tokens, benchmark files) is refused
  before the model loads; each prompt's records go to `<out_dir>/records.jsonl` as soon as they are
  measured, and the same command with the same `out_dir` resumes there (`dart_infer.evaluation.records`);
  the table is printed before results.json/.md and the plots are written (`dart_infer.evaluation.results`).
"""

from __future__ import annotations

import itertools
import logging
import platform
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from dart_infer.cli import hydra_app
from dart_infer.cli.eval_checks import (
    benchmark_names,
    check_count,
    check_eval_inputs,
    check_out_dir,
    resolve_compile,
    run_settings,
)
from dart_infer.cli.tree_files import check_tree_file, tree_file_overrides, write_fit
from dart_infer.common.dtypes import dtype_name
from dart_infer.common.errors import InputError
from dart_infer.data.assets import resolve_model
from dart_infer.data.conversations import Conversation, load_conversations, load_prompt_file

log = logging.getLogger(__name__)


def benchmark_conversations(name: str, limit: int | None) -> list[Conversation]:
    """`mtbench`, `humaneval`, `sharegpt-heldout`, `hf:<dataset>`, or a prompt file path; one that
    yields no prompt (an empty file, another schema) is refused here, before any model loads."""
    name = str(name)
    if name == "sharegpt":
        raise InputError("benchmarks: 'sharegpt' would evaluate on training data; use 'sharegpt-heldout'")
    if name == "sharegpt-heldout":
        conversations = load_conversations("sharegpt", split="heldout", limit=limit)
    elif name.lower() in ("mtbench", "humaneval") or name.startswith("hf:") or not Path(name).expanduser().exists():
        conversations = load_conversations(name, limit=limit)  # an unknown name fails here, naming it
    else:
        return load_prompt_file(name, limit=limit)
    if not any(m["role"] == "user" for c in conversations for m in c.messages):
        raise InputError(f"benchmarks: {name} yields no prompt with a user turn; pick another benchmark")
    return conversations


# ------------------------------------------------------------------------------------ models, trie


def _dtypes(cfg: DictConfig) -> tuple[torch.dtype, list[torch.dtype]]:
    """(serving dtype, the other dtypes the plain methods are timed in)."""
    from dart_infer.common.dtypes import as_dtype

    serving = as_dtype(cfg.model.dtype)
    others = [as_dtype(d) for d in cfg.get("baseline_dtypes") or []]
    return serving, list(dict.fromkeys(d for d in others if d != serving))


def resolve_trie(cfg: DictConfig) -> str | None:
    """The trie file to load (None: no trie), decided before any model loads (`dart_infer.data.resolve`).

    `auto`: `default_ngram_model` when it exists and was built with this model's tokenizer, else
    None with one line saying so; null/"none": None; a path: it must exist, load and fit (a corrupt
    file is refused here; `ngram_verify` adds the payload checksum to the load's structural check).
    """
    from dart_infer.data.resolve import model_vocabulary, trie_from_config

    def vocabulary() -> tuple[Any, int]:
        return model_vocabulary(cfg.model.name_or_path, cfg.model.get("chat_template"))

    choice = trie_from_config(cfg, vocabulary, mmap=True)  # the model loads it again, as configured
    if choice.notice:
        print(choice.notice, flush=True)
    return choice.path


def methods_for(methods: Sequence[str], trie: str | None) -> list[str]:
    """Without a trie `dart` is DART without one: it becomes `dart_no_trie` (once)."""
    if trie is not None or "dart" not in methods:
        return list(methods)
    out = ["dart_no_trie" if m == "dart" else m for m in methods]
    print("no n-gram trie: method 'dart' runs as 'dart_no_trie'", flush=True)
    return list(dict.fromkeys(out))


def load_models(cfg: DictConfig, trie: str | None) -> tuple[Any, list[Any]]:
    """(serving model, plain-method models in the other dtypes). One load: in float32 when several
    dtypes are timed (casting float32 down is what loading in each dtype gives), else in `model.dtype`."""
    from dart_infer.decoding.dart_model import DartModel

    serving_dtype, others = _dtypes(cfg)
    load_dtype = torch.float32 if others else serving_dtype
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    loaded = DartModel.from_pretrained(
        resolve_model(cfg.model.name_or_path), cfg.draft_model, trie, dtype=load_dtype, tree=tree,
        ngram_mmap=bool(cfg.ngram_mmap), ngram_verify=bool(cfg.get("ngram_verify", False)),
        chat_template=cfg.model.get("chat_template"),
    )
    by_dtype = {load_dtype: loaded}
    for dtype in (serving_dtype, *others):
        if dtype not in by_dtype:
            by_dtype[dtype] = loaded.with_dtype(dtype)
    serving = by_dtype[serving_dtype]
    if cfg.get("bf16_weights", False):  # the served model only: the other dtypes' copies are made above
        serving.use_bf16_weights()
    if serving.method is not None:
        serving.tree  # noqa: B018  tree=auto fits its size now (seconds, once per machine), before anything is timed
    return serving, [by_dtype[d] for d in others]


def load_eagle3(cfg: DictConfig, model: Any) -> Any:
    """The `eagle3` method's model (None unless it is asked for): the serving model's target (shared,
    not loaded again) with the EAGLE-3 head at `eagle3_model`, in its dtype, with `eagle3_tree` overrides."""
    if "eagle3" not in cfg.methods:
        return None
    if not cfg.get("eagle3_model"):
        raise InputError("methods: 'eagle3' needs eagle3_model=<an EAGLE-3 head directory>")
    from dart_infer.methods import load_head

    head, method = load_head(str(cfg.eagle3_model))
    if method.name != "eagle3":
        raise InputError(f"eagle3_model={cfg.eagle3_model}: that is a {method.display_name} head, not an EAGLE-3 one")
    tree = OmegaConf.to_container(cfg.eagle3_tree, resolve=True) if cfg.get("eagle3_tree") else None
    return model.with_head(head, tree=tree)


def start_vllm(cfg: DictConfig, scratch: Path, trie: str | None = None) -> dict[str, Any]:
    """The engines of the vLLM methods in `cfg.methods` (`dart_infer.engines.vllm.runner.start_engines`), in
    `model.dtype`; exported heads go into `scratch`; `trie`: the resolved ngram_model (vllm_dart_trie)."""
    from dart_infer.engines.vllm.runner import start_engines

    wanted = [str(m) for m in cfg.methods if str(m).startswith("vllm")]
    if not wanted:
        return {}
    return start_engines(
        wanted, resolve_model(cfg.model.name_or_path), dtype_name(_dtypes(cfg)[0]), scratch,
        draft_model=cfg.get("draft_model"), eagle3_model=cfg.get("eagle3_model"),
        ngram_tokens=int(cfg.prompt_lookup_num_tokens), eagle3_tokens=int(cfg.vllm_eagle3_tokens),
        enforce_eager=bool(cfg.get("vllm_enforce_eager", False)), trie=trie,
    )


def load_model(cfg: DictConfig, trie: str | None) -> Any:
    """The serving model alone (`model.dtype`, the tree configured, `trie` from `resolve_trie`)."""
    return load_models(OmegaConf.merge(cfg, {"baseline_dtypes": []}), trie)[0]


def samplings_from(cfg: DictConfig) -> list[Any]:
    """`temperature` (one value or a list) x the shared `top_p`/`top_k` → `Sampling` settings."""
    from dart_infer.evaluation.evaluate import Sampling

    temperatures = cfg.temperature
    if not isinstance(temperatures, (list, tuple, ListConfig)):
        temperatures = [temperatures]
    return [Sampling(float(t), float(cfg.top_p), int(cfg.top_k)) for t in temperatures]


def run_eval(cfg: DictConfig) -> dict[str, Path]:
    from dart_infer.evaluation.evaluate import EvalSettings, Evaluator
    from dart_infer.evaluation.records import RecordStore
    from dart_infer.evaluation.results import ResultsNotWritten, markdown_table, save_results, summarize

    # Everything that can be refused is refused here, before the model loads and nothing is measured.
    check_eval_inputs(cfg)
    benchmarks = {name: benchmark_conversations(name, cfg.limit) for name in benchmark_names(cfg)}
    trie = resolve_trie(cfg)
    settings = EvalSettings(
        methods=methods_for(list(cfg.methods), trie), max_new_tokens=cfg.max_new_tokens, multi_turn=cfg.multi_turn,
        prompt_lookup_num_tokens=cfg.prompt_lookup_num_tokens, threads=cfg.threads, samplings=samplings_from(cfg),
        seed=int(cfg.seed),
    )
    _dtypes(cfg)  # bad dtype names fail here, before the model loads
    check_tree_file(cfg)
    resolve_compile(cfg)
    store = RecordStore.open(cfg.out_dir, run_settings(cfg, trie, settings))  # other settings: refused
    units = [unit for name, conversations in benchmarks.items() for unit in settings.units(name, conversations)]
    done = store.count(units)
    if done:
        print(f"resuming: {done} of {len(units)} measurements already in {store.path}", flush=True)
    torch.manual_seed(cfg.seed)
    scratch = Path(tempfile.mkdtemp(prefix="dart-eval-"))
    vllm = start_vllm(cfg, scratch, trie)  # first: a missing vLLM venv or a bad export fails before our models load
    model, plain_models = load_models(cfg, trie)
    eagle3 = load_eagle3(cfg, model)
    if cfg.compile:
        from dart_infer.decoding.compile import compile_decoding

        for decoding in (model, *plain_models, *([eagle3] if eagle3 else [])):
            compile_decoding(decoding, plain=True)  # the AR baselines are timed too
    evaluator = Evaluator(model, settings, plain_models, eagle3=eagle3, vllm=vllm)
    store.confirm({"tree": asdict(model.tree), "eagle3_tree": asdict(eagle3.tree) if eagle3 else None,
                   "device": str(model.target.device)})
    if done < len(units):
        evaluator.warm_up()
    records = []
    try:
        for name, conversations in benchmarks.items():
            records += evaluator.run(name, conversations, resume=store.lookup, save=store.append)
    except BaseException:  # Ctrl-C, out of memory, ...: say what is kept and how to go on
        print(f"stopped: {store.count(units)} of {len(units)} measurements are saved in {store.path}; the same "
              f"command with out_dir={cfg.out_dir} measures only the rest", file=sys.stderr, flush=True)
        raise
    finally:
        for engine in vllm.values():
            engine.close()
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(records, max(model.draft_depth, eagle3.draft_depth if eagle3 else 0))
    meta = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "serving_dtype": dtype_name(model.target.dtype) + (" (bf16 weights)" if cfg.get("bf16_weights") else ""),
        "plain_dtypes": [dtype_name(m.target.dtype) for m in plain_models],
        "methods": list(settings.methods),
        "ngram_model": trie,
        "tree": asdict(model.tree),
        "eagle3_model": str(cfg.eagle3_model) if eagle3 else None,
        "eagle3_tree": asdict(eagle3.tree) if eagle3 else None,
        "device": str(model.target.device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "records_file": str(store.path),
        "resumed_measurements": done,
    }
    # The table first, from memory: a file that cannot be written below never takes it away.
    print(markdown_table(summary) + "\n", flush=True)
    saved = save_results(cfg.out_dir, records, summary, meta)
    paths = {"records": store.path, **saved.paths}
    for kind, path in paths.items():
        print(f"{kind}: {path}", flush=True)
    if not saved.results_written:  # a plot is optional; the results files are what the run promised
        failed = "; ".join(f"{path} ({reason})" for path, reason in saved.results_failed.items())
        raise ResultsNotWritten(f"could not write {failed}; the table is above and every measurement is in "
                                f"{store.path}: re-run the same command once {cfg.out_dir} is writable to write "
                                "the results without measuring again")
    return paths


def run_fit_tree(cfg: DictConfig) -> Path:
    from dart_infer.data.conversations import chat_prompt, first_turn
    from dart_infer.evaluation.tree_fit import fit_tree, tree_sizes

    check_count(cfg, "fit.prompts")
    check_count(cfg, "fit.max_new_tokens")
    check_out_dir(cfg.out_dir)
    conversations = benchmark_conversations(benchmark_names(cfg)[0], cfg.fit.prompts)
    eagle3 = str(cfg.fit.get("method", "dart")) == "eagle3"
    trie = None if eagle3 else resolve_trie(cfg)
    resolve_compile(cfg)
    model = load_model(cfg, trie)
    if eagle3:  # EAGLE-3's dynamic tree on the same target (fit.eagle3_grid)
        model = load_eagle3(OmegaConf.merge(cfg, {"methods": ["eagle3"]}), model)
    prompts = [chat_prompt(model.tokenizer, first_turn(c)) for c in conversations]
    space = cfg.fit.eagle3_grid if eagle3 else cfg.fit.grid
    keys = list(space)
    grid = [dict(zip(keys, values, strict=True)) for values in itertools.product(*(space[k] for k in keys))]
    if cfg.compile:  # fitted on the compiled step it will be served with: each size its own graph
        from dart_infer.decoding.compile import compile_decoding

        compile_decoding(model, tree_sizes=tree_sizes(model, grid), plain=True)  # fit_tree times AR
    results = fit_tree(model, prompts, grid, cfg.fit.max_new_tokens)
    # The whole tree (the fields not searched as configured), so the file alone reproduces it.
    best = {**{k: v for k, v in asdict(model.tree).items() if k not in keys and v is not None},
            **{k: results[0][k] for k in keys}}
    meta = {
        "dtype": str(cfg.model.dtype),
        "device": str(model.target.device),
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "model": str(cfg.model.name_or_path),
        "draft_model": str(cfg.eagle3_model if eagle3 else cfg.draft_model),
        "ngram_model": trie,
        "speedup_vs_ar": results[0]["speedup_vs_ar"],
        "method": "eagle3" if eagle3 else "dart",
        "compiled": bool(cfg.compile),  # fitted on the compiled step (dart-eval compile=true) or the eager one
    }
    # The table before the file: a failed write still leaves the measurements on screen.
    print("| " + " | ".join(keys) + " | τ | tokens/s | speedup vs AR |")
    print("|" + "---|" * (len(keys) + 3))
    for r in results:
        print("| " + " | ".join(str(r[k]) for k in keys) + f" | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | {r['speedup_vs_ar']:.2f}× |")
    print(f"best tree on this machine ({cfg.model.dtype}): {best} ({results[0]['speedup_vs_ar']:.2f}× AR)", flush=True)
    path = write_fit(cfg.out_dir, best, results, meta)
    if eagle3:
        flags = " ".join(f"eagle3_tree.{k}={v}" for k, v in best.items())
        print(f"wrote {path}; evaluate with it: dart-eval methods=[ar,dart,eagle3] eagle3_model={cfg.eagle3_model} {flags}")
    else:
        print(f"wrote {path}; evaluate with it: dart-eval tree={path}")
    return path


@hydra_app("eval")
def _app(cfg: DictConfig) -> None:
    if cfg.action == "eval":
        run_eval(cfg)
    elif cfg.action == "fit_tree":
        run_fit_tree(cfg)
    else:
        raise ValueError(f"unknown action {cfg.action!r}: use 'eval' or 'fit_tree'")


def main() -> None:
    """The `dart-eval` console script: `tree=<fit_tree.yaml or its run dir>` becomes that tree's settings."""
    sys.argv[1:] = tree_file_overrides(sys.argv[1:])
    _app()
