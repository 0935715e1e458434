"""Shared plumbing of the Hydra entry points (`dart-train`, `dart-ngram`, `dart-eval`, `dart-demo`).

Entry points are thin apps: parse the config, print it, call library components. Apps follow the
import direction dart_train -> dart_infer -> ngram_builder like everything else (tests/test_layout.py):
`dart-ngram` and `dart-eval` live here, `dart-train` and `dart-demo` in dart_train. Every console
script starts under tcmalloc where it is installed (dart_infer.allocator: ~1.2x faster training steps).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dart_infer.allocator import describe_allocator, use_fast_allocator

log = logging.getLogger(__name__)


def configs_dir() -> Path:
    """The Hydra config tree: `configs/` of a source checkout, else the copy installed in the wheel."""
    checkout = Path(__file__).resolve().parents[2] / "configs"
    if checkout.is_dir():
        return checkout
    spec = find_spec("dart_configs")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise FileNotFoundError(
        "Cannot find the Hydra configs: neither configs/ next to the packages nor an installed "
        "dart_configs/ directory. Reinstall the package (`pip install .`)."
    )


def hydra_app(config_name: str) -> Callable[[Callable[[DictConfig], object]], Callable[[], None]]:
    """Turn `fn(cfg)` into a console-script `main()` that runs under Hydra with `configs/<name>.yaml`.

    The resolved config is printed before the job starts (Hydra also saves it, with the overrides,
    under the run's `.hydra/` directory).
    """
    import hydra

    def decorate(fn: Callable[[DictConfig], object]) -> Callable[[], None]:
        @hydra.main(config_path=str(configs_dir()), config_name=config_name, version_base="1.3")
        def _run(cfg: DictConfig) -> None:
            # Offline by default: this project's defaults never need the network.
            os.environ.setdefault("WANDB_MODE", "offline")
            print(f"# resolved config ({config_name})\n" + OmegaConf.to_yaml(cfg, resolve=True), flush=True)
            fn(cfg)

        @functools.wraps(fn)
        def main() -> None:
            use_fast_allocator()  # may re-execute this script once, with tcmalloc preloaded
            print(f"# {describe_allocator()}", flush=True)
            _run()

        return main

    return decorate
