"""`dart-demo`: the end-to-end main job (configs/demo.yaml): trie → a short training run → the
shipped head's (or the trained head's) τ and speedup.

Each stage composes its own entry point's config (`ngram`, `train`, `eval`) with the demo's overrides
and calls the same function that entry point runs, so the demo exercises exactly the user-facing path.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra import compose
from hydra.errors import HydraException
from omegaconf import DictConfig, open_dict

from dart_infer.cli import hydra_app
from dart_infer.cli.checks import check_composed, hydra_error
from dart_infer.common.errors import InputError

log = logging.getLogger(__name__)


def _compose(name: str, cfg: DictConfig, overrides: list[str], dtype: str | None = None) -> DictConfig:
    shared = [f"model.name_or_path={cfg.model.name_or_path}", f"model.dtype={dtype or cfg.model.dtype}"]
    hardware = hardware_choice()
    if hardware and name in ("train", "eval"):  # the ngram stage has no hardware group
        shared.append(f"hardware={hardware}")
    try:
        stage = compose(config_name=name, overrides=[*shared, *overrides])
        check_composed(f"dart-{name}", name, stage, [*shared, *overrides])
    except (HydraException, InputError) as err:
        raise InputError(f"the demo's {name} stage: {hydra_error(err, f'dart-{name}', name)}") from err
    # Every stage renders conversations with the demo's chat template (set here, not as an override
    # string: a Jinja string would need Hydra quoting).
    with open_dict(stage):
        stage.model.chat_template = cfg.model.get("chat_template")
    return stage


def hardware_choice() -> str | None:
    """The `hardware=` group chosen for the demo (cpu | gpu), passed on to its training and
    evaluation stages; None = their own defaults."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get("hardware") if HydraConfig.initialized() else None


def serve_dtype(cfg: DictConfig) -> str:
    """`serve_dtype` resolved (`dart_infer.common.dtypes.resolve_dtype_name`: auto = bf16 where it measures faster)."""
    from dart_infer.common.dtypes import resolve_dtype_name

    return resolve_dtype_name(str(cfg.serve_dtype))


def ngram_config(cfg: DictConfig) -> DictConfig:
    return _compose("ngram", cfg, list(cfg.ngram_overrides))


def trie_file(ngram_cfg: DictConfig) -> Path:
    """The trie the ngram stage writes (and reuses when it exists)."""
    return Path(ngram_cfg.out_dir) / "full.ngt"


def build_trie(ngram_cfg: DictConfig) -> Path:
    from dart_infer.cli.ngram import run_build

    trie = trie_file(ngram_cfg)
    if trie.exists():
        print(f"[demo 1/3] reusing the trie {trie} (delete it to rebuild)", flush=True)
        return trie
    print(f"[demo 1/3] building the n-gram trie from {ngram_cfg.ngram.name} into {ngram_cfg.out_dir}", flush=True)
    run_build(ngram_cfg)
    return trie


def train_config(cfg: DictConfig, trie: Path) -> DictConfig:
    """dart-train's config for the demo's training stage; the types of its trainer group are checked
    here too (e.g. a trainer.max_minutes that is not a number), before the trie build."""
    from dart_train.builders import trainer_config

    run_dir = Path(cfg.out_dir) / "train"
    # The head to be served goes through the same held-out evaluation, so the two τ printed compare.
    compare = [f"train_eval.compare_head={cfg.draft_model}"] if cfg.draft_model else []
    stage = _compose("train", cfg, [*cfg.train_overrides, f"output_dir={run_dir}", f"train_eval.ngram_model={trie}",
                                    *compare])
    try:
        trainer_config(stage)
    except InputError as err:
        raise InputError(f"the demo's train stage: {err}") from err
    return stage


def train_head(train_cfg: DictConfig) -> Path:
    from dart_train.cli import train

    print(f"[demo 2/3] training a DART head into {train_cfg.output_dir}", flush=True)
    summary = train(train_cfg)
    print(trained_line(summary), flush=True)
    best = summary.get("best") or {}
    if best.get("tau") is not None:
        print(f"[demo 2/3] held-out τ, simulated on {train_cfg.train_eval.limit} held-out ShareGPT conversations "
              "(the paper's search: draft + trie; with the serving tree's context n-grams and copy spans in brackets,"
              " which also accept wherever the text repeats itself):", flush=True)
        print(f"[demo 2/3]   the head trained now (best of {summary['steps']} steps, step {best['step']}): "
              f"{_taus(best)}", flush=True)
        other = summary.get("compare")
        if other:
            print(f"[demo 2/3]   {other['head']} (served next), same evaluation: {_taus(other)}", flush=True)
    return Path(summary["head"])


def trained_line(summary: dict) -> str:
    """One line from the training summary: the steps and tokens reached, in how many minutes, and
    whether the time budget (train_minutes) ended the run before train_steps."""
    steps, total = summary.get("steps"), summary.get("total_steps")
    line = f"[demo 2/3] trained {steps}" + (f" of {total}" if total else "") + " steps"
    if summary.get("tokens") is not None:
        line += f", {int(summary['tokens']):,} tokens"
    if summary.get("minutes") is not None:
        line += f" in {float(summary['minutes']):.1f} minutes"
    if summary.get("stopped_on") == "time_budget":
        line += f" (stopped by the time budget, train_minutes={float(summary['max_minutes']):g})"
    return line


def _taus(result: dict) -> str:
    served = f" ({result['tau_served']:.2f})" if result.get("tau_served") is not None else ""
    return f"τ {result['tau']:.2f}{served}"


def machine_overrides(cfg: DictConfig, dtype: str) -> list[str]:
    """The eval stage's settings fitted to this machine (before the demo's own `eval_overrides`, which win).

    `bf16_weights: auto` serves float32 with bf16 weights where serve_dtype=auto chose float32 on a CPU
    without bf16 arithmetic (`dart_infer.target.bf16_weights`). `compile: auto` compiles where DART is
    served in plain float32 on a CPU and the target can be compiled (full attention): there an eager tree
    verification costs more than DART saves (AVX2 kernels: DART 0.84x eager AR), while the compiled
    steps make it ~2x, and the compile is paid back within the stage; with bf16 weights the eager
    steps are as fast. The plain baselines skip bfloat16 on CPUs without bf16 kernels (AVX2-only), which would run
    it through slow fallbacks for minutes."""
    from transformers import AutoConfig

    from dart_infer.common.dtypes import as_dtype, default_device
    from dart_infer.common.machine import cpu_has_bf16_kernels
    from dart_infer.data.assets import resolve_model
    from dart_infer.decoding.compile import compile_pays
    from dart_infer.target.bf16_weights import resolve_bf16_weights

    on_cpu = default_device().type == "cpu"
    bf16_weights = resolve_bf16_weights(cfg.bf16_weights, cfg.serve_dtype, as_dtype(dtype), default_device())
    compiled = str(cfg.compile).lower()
    if compiled == "auto":  # bf16 DART pays eagerly too: the demo's minutes go to compiling only where it must
        compiled = str(dtype == "float32" and compile_pays(
            AutoConfig.from_pretrained(resolve_model(str(cfg.model.name_or_path))), default_device(),
            bf16_weights=bf16_weights)).lower()
    overrides = [f"compile={compiled}", f"bf16_weights={str(bf16_weights).lower()}"]
    if on_cpu and not cpu_has_bf16_kernels():
        overrides.append("baseline_dtypes=[float32]")
    return overrides


def eval_config(cfg: DictConfig, head: Path | str, trie: Path) -> DictConfig:
    """dart-eval's config for the demo's last stage: its overrides, the head and trie just made, DART
    in `serve_dtype`, the plain baselines in eval's `baseline_dtypes` (`machine_overrides`)."""
    from dart_infer.cli.tree_files import tree_file_overrides

    dtype = serve_dtype(cfg)
    overrides = [*machine_overrides(cfg, dtype), *cfg.eval_overrides, f"draft_model={head}", f"ngram_model={trie}",
                 f"out_dir={Path(cfg.out_dir) / 'eval'}"]
    return _compose("eval", cfg, tree_file_overrides(overrides), dtype=dtype)


@hydra_app("demo")
def main(cfg: DictConfig) -> None:
    from dart_infer.cli.eval import run_eval
    from dart_infer.data.assets import EMBEDDED_HEADS

    if int(cfg.train_steps) <= 0 and not cfg.draft_model:
        raise InputError("train_steps=0 skips training, so give the head to serve: draft_model=<name or directory>")
    # Every stage's config is composed and checked before the first stage starts (the eval stage's
    # with the shipped head standing in for the one still to be trained).
    ngram_cfg = None if cfg.ngram_model else ngram_config(cfg)
    trie = Path(cfg.ngram_model) if cfg.ngram_model else trie_file(ngram_cfg)
    train_cfg = train_config(cfg, trie) if int(cfg.train_steps) > 0 else None
    eval_config(cfg, cfg.draft_model or next(iter(EMBEDDED_HEADS)), trie)
    if ngram_cfg is not None:
        build_trie(ngram_cfg)
    trained = train_head(train_cfg) if train_cfg is not None else None
    head = str(cfg.draft_model) if cfg.draft_model else trained
    print(f"[demo 3/3] serving the head {head}" + (" (shipped with the package)" if cfg.draft_model in
          EMBEDDED_HEADS else "") + ": the τ below is real decoding on MT-Bench with the serving tree", flush=True)
    eval_cfg = eval_config(cfg, head, trie)
    print(f"[demo 3/3] evaluating on {list(eval_cfg.benchmarks)} (limit {eval_cfg.limit}), DART in "
          f"{eval_cfg.model.dtype}{' with bf16 weights' if eval_cfg.get('bf16_weights') else ''}"
          f"{' (compiled steps: compile=true)' if eval_cfg.compile else ''}, plain decoding "
          f"also in {list(eval_cfg.baseline_dtypes)}", flush=True)
    run_eval(eval_cfg)
    print(f"head served: {head}\nhead trained: {trained}\ntrie: {trie}\nresults: {Path(cfg.out_dir) / 'eval'}",
          flush=True)
