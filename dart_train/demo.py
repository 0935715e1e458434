"""`dart-demo`: the end-to-end main job on the embedded defaults (Hydra app, configs/demo.yaml)."""

from __future__ import annotations

from omegaconf import DictConfig

from dart_infer.assets import resolve_model
from dart_infer.cli import hydra_app
from dart_infer.conversations import load_conversations


@hydra_app("demo")
def main(cfg: DictConfig) -> None:
    model_path = resolve_model(cfg.model.name_or_path)
    train = load_conversations(cfg.data.source, split=cfg.data.split, limit=cfg.data.limit)
    prompts = load_conversations(cfg.eval_data.source, split=cfg.eval_data.split, limit=cfg.eval_data.limit)
    print(f"model: {model_path}")
    print(f"training data: {cfg.data.source}/{cfg.data.split}: {len(train)} conversations")
    print(f"eval prompts: {cfg.eval_data.source}: {len(prompts)}")
