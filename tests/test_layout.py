"""Imports go one way: dart_train → dart_infer → ngram_builder (README, "Layout").

Every import statement of every module is checked, function-local ones and relative ones included,
by parsing the source (nothing is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it must not import
FORBIDDEN = {
    "ngram_builder": {"dart_infer", "dart_train"},
    "dart_infer": {"dart_train"},
}


def imported_packages(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in the file; relative imports resolve to `package`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, package if node.level else (node.module or "").split(".")[0]))
    return sorted(found)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found under {package}/"
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in files
        for line, name in imported_packages(path, package)
        if name in FORBIDDEN[package]
    ]
    assert not wrong, "imports against the one-way rule:\n" + "\n".join(wrong)


def test_the_checker_sees_local_and_relative_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from dart_train.engine import x\n    import dart_infer.model\n"
                      "from . import sibling\n")
    assert imported_packages(module, "ngram_builder") == [
        (1, "os"), (4, "dart_train"), (5, "dart_infer"), (6, "ngram_builder"),
    ]
