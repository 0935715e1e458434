"""Every console script starts, composes its Hydra config and prints it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ENTRY_POINTS = ["dart-train", "dart-ngram", "dart-eval", "dart-demo"]


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"console script {name} is not installed (pip install -e .)"
    return found


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_composes_and_prints_its_config(name: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [_script(name), "--cfg", "job"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model:" in result.stdout and "name_or_path:" in result.stdout


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_unknown_config_keys_are_rejected(name: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [_script(name), "--cfg", "job", "no_such_key=1"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert result.returncode != 0
    assert "no_such_key" in result.stderr
