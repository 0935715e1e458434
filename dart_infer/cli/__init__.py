"""Shared plumbing of the Hydra entry points (`dart-train`, `dart-ngram`, `dart-eval`, `dart-demo`).

Entry points are thin apps: parse the config, print it, call library components. Apps follow the
import direction dart_train -> dart_infer -> ngram_builder like everything else (tests/test_layout.py):
`dart-ngram` and `dart-eval` live here, `dart-train` and `dart-demo` in dart_train. Every console
script starts under tcmalloc where it is installed (dart_infer.common.allocator: ~1.2x faster training steps).

Every command checks its composed config first (`checks.check_config`: unknown keys, types, ranges,
names) and reports any error as one line with a documented exit code (`dart_infer.common.errors`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from dart_infer.cli.checks import check_hydra_job, hydra_error
from dart_infer.common.allocator import describe_allocator, use_fast_allocator
from dart_infer.common.configs import configs_dir
from dart_infer.common.errors import report

log = logging.getLogger(__name__)


def hydra_app(config_name: str) -> Callable[[Callable[[DictConfig], object]], Callable[[], None]]:
    """Turn `fn(cfg)` into a console-script `main()` that runs under Hydra with `configs/<name>.yaml`.

    The resolved config is printed before the job starts (Hydra also saves it, with the overrides,
    under the run's `.hydra/` directory).
    """
    import hydra

    def decorate(fn: Callable[[DictConfig], object]) -> Callable[[], None]:
        command = f"dart-{config_name}"

        failures: list[int] = []  # exit codes of failed jobs (a multirun goes on to its next job)

        @hydra.main(config_path=str(configs_dir()), config_name=config_name, version_base="1.3")
        def _run(cfg: DictConfig) -> None:
            # Offline by default: this project's defaults never need the network.
            os.environ.setdefault("WANDB_MODE", "offline")
            try:
                check_hydra_job(command, config_name, cfg)
                print(f"# resolved config ({config_name})\n" + OmegaConf.to_yaml(cfg, resolve=True), flush=True)
                fn(cfg)
            except Exception as err:  # reported here, as one line, instead of by Hydra
                failures.append(report(err, command))

        @functools.wraps(fn)
        def main() -> None:
            use_fast_allocator()  # may re-execute this script once, with tcmalloc preloaded
            print(f"# {describe_allocator()}", flush=True)
            # Hydra raises its own config errors instead of printing a trimmed traceback.
            os.environ["HYDRA_FULL_ERROR"] = "1"
            try:
                _run()
            except (Exception, KeyboardInterrupt) as err:
                sys.exit(report(hydra_error(err, command, config_name), command))
            if failures:
                sys.exit(failures[0])

        return main

    return decorate
