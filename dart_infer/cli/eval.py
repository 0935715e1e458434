"""`dart-eval`: measure τ and wall-clock speedup on a benchmark (Hydra app, configs/eval.yaml)."""

from __future__ import annotations

from omegaconf import DictConfig

from dart_infer.assets import resolve_model
from dart_infer.cli import hydra_app
from dart_infer.conversations import load_conversations


@hydra_app("eval")
def main(cfg: DictConfig) -> None:
    model_path = resolve_model(cfg.model.name_or_path)
    prompts = load_conversations(cfg.data.source, split=cfg.data.split, limit=cfg.limit or cfg.data.limit)
    print(f"model: {model_path}\nbenchmark: {cfg.data.source} ({len(prompts)} prompts)")
