"""`dart-eval`: τ and wall-clock speedup on benchmarks, and tree sizing for this machine (configs/eval.yaml)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from dart_infer.assets import resolve_model
from dart_infer.cli import configs_dir, hydra_app
from dart_infer.conversations import Conversation, load_conversations

log = logging.getLogger(__name__)

FITTED_HEADER = "# Written by `dart-eval action=fit_tree`"


def benchmark_conversations(name: str, limit: int | None) -> list[Conversation]:
    """`mtbench`, `humaneval`, `sharegpt-heldout`, or a prompt file path."""
    if name == "sharegpt-heldout":
        return load_conversations("sharegpt", split="heldout", limit=limit)
    if name == "sharegpt":
        raise ValueError("benchmark 'sharegpt' would evaluate on training data; use 'sharegpt-heldout'")
    return load_conversations(name, limit=limit)


def load_model(cfg: DictConfig) -> Any:
    from dart_infer.generate import DartModel

    dtype = getattr(torch, cfg.model.dtype)
    tree = OmegaConf.to_container(cfg.tree, resolve=True)
    return DartModel.from_pretrained(
        resolve_model(cfg.model.name_or_path), cfg.draft_model, cfg.ngram_model, dtype=dtype, tree=tree,
        ngram_mmap=bool(cfg.ngram_mmap)
    )


def run_eval(cfg: DictConfig) -> dict[str, Path]:
    from dart_infer.evaluate import EvalSettings, Evaluator, save_results, summarize

    settings = EvalSettings(
        methods=list(cfg.methods), max_new_tokens=cfg.max_new_tokens, multi_turn=cfg.multi_turn,
        prompt_lookup_num_tokens=cfg.prompt_lookup_num_tokens, threads=cfg.threads,
    )
    # Bad benchmark names or files fail here, before the model loads.
    benchmarks = {name: benchmark_conversations(name, cfg.limit) for name in cfg.benchmarks}
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    evaluator = Evaluator(model, settings)
    evaluator.warm_up()
    records = []
    for name, conversations in benchmarks.items():
        records += evaluator.run(name, conversations)
    summary = summarize(records, model.draft_model.config.draft_length)
    meta = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    paths = save_results(cfg.out_dir, records, summary, meta)
    print((Path(paths["markdown"])).read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return paths


def run_fit_tree(cfg: DictConfig) -> Path:
    from dart_infer.evaluate import chat_prompt, first_turn, fit_tree

    conversations = benchmark_conversations(cfg.benchmarks[0], cfg.fit.prompts)
    model = load_model(cfg)
    prompts = [chat_prompt(model.tokenizer, first_turn(c)) for c in conversations]
    keys = list(cfg.fit.grid)
    grid = [dict(zip(keys, values, strict=True)) for values in itertools.product(*(cfg.fit.grid[k] for k in keys))]
    results = fit_tree(model, prompts, grid, cfg.fit.max_new_tokens)
    best = {k: results[0][k] for k in keys}
    best["ngram_weight"] = float(cfg.tree.ngram_weight)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fit_tree.yaml").write_text(yaml.safe_dump({"best": best, "all": results}, sort_keys=False))
    print("| " + " | ".join(keys) + " | τ | tokens/s | speedup vs AR |")
    print("|" + "---|" * (len(keys) + 3))
    for r in results:
        print("| " + " | ".join(str(r[k]) for k in keys) + f" | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | {r['speedup_vs_ar']:.2f}× |")
    print(f"best tree on this machine: {best} ({results[0]['speedup_vs_ar']:.2f}× AR); all results: {out / 'fit_tree.yaml'}")
    if cfg.fit.write_config:
        target = configs_dir() / "tree" / "fitted.yaml"
        if target.exists() and not target.read_text().startswith(FITTED_HEADER):
            print(f"not overwriting {target}: it was not written by dart-eval (copy the settings by hand)")
        else:
            target.write_text(f"{FITTED_HEADER} on this machine; use it with tree=fitted.\n" + yaml.safe_dump(best))
            print(f"wrote {target} (use tree=fitted)")
    return out / "fit_tree.yaml"


@hydra_app("eval")
def main(cfg: DictConfig) -> None:
    if cfg.action == "eval":
        run_eval(cfg)
    elif cfg.action == "fit_tree":
        run_fit_tree(cfg)
    else:
        raise ValueError(f"unknown action {cfg.action!r}: use 'eval' or 'fit_tree'")
