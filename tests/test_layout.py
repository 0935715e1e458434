"""The architecture as the tree shows it (README, "Layout").

- Imports go one way between the packages: dart_train → dart_infer → ngram_builder.
- Inside dart_infer and dart_train, each part (a subpackage, or one of dart_train's top modules)
  imports only the parts listed before it in `LAYERS`, and no modules import each other in a circle.
- Every module sits in a part that `LAYERS` names; every subpackage says what it owns.

Every import statement of every module is checked, function-local ones and relative ones included,
by parsing the source (nothing is imported).
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it must not import
FORBIDDEN = {
    "ngram_builder": {"dart_infer", "dart_train"},
    "dart_infer": {"dart_train"},
}

# The parts of each package, lowest first: a part may import itself and the parts before it.
LAYERS = {
    "dart_infer": ["common", "tree", "data", "target", "methods", "decoding", "engines", "evaluation", "app", "cli"],
    "dart_train": ["common", "data", "states", "objectives", "trainer", "builders", "cli", "demo"],
}
# Compiled extensions: leaves that import nothing of the package.
EXTENSIONS = {"dart_infer._search", "ngram_builder._core"}


def imported_packages(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in the file; relative imports resolve to `package`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, package if node.level else (node.module or "").split(".")[0]))
    return sorted(found)


def modules_of(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` (a package is its `__init__`)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def module_imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) of every import of a module of the same package. `from a import b` names
    module `a.b` when that is a module, else `a`; relative imports are resolved against `name`."""
    package = name.split(".")[0]
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == package]
        elif isinstance(node, ast.ImportFrom):
            base = (node.module or "") if not node.level else ".".join(
                here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] != package:
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.append((node.lineno, child if child in modules or child in EXTENSIONS else base))
    return found


def part_of(module: str) -> str | None:
    """The part a module belongs to: the name after the package (None for the package's own __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


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


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_every_module_sits_in_a_named_part(package: str) -> None:
    modules = modules_of(package)
    unnamed = sorted(m for m in modules if part_of(m) is not None and part_of(m) not in LAYERS[package])
    assert not unnamed, f"modules outside the parts of {package} (LAYERS): {unnamed}"
    packages = [p for p in modules.values() if p.name == "__init__.py" and p.parent != ROOT / package]
    silent = sorted(str(p.relative_to(ROOT)) for p in packages if not ast.get_docstring(ast.parse(p.read_text())))
    assert not silent, f"subpackages whose __init__ does not say what they own: {silent}"


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_parts_import_only_the_parts_below(package: str) -> None:
    modules, order = modules_of(package), LAYERS[package]
    wrong = []
    for name, path in modules.items():
        part = part_of(name)
        if part is None:  # the package's own __init__: the public names, resolved lazily
            continue
        for line, imported in module_imports(path, name, modules):
            target = part_of(imported)
            if imported in EXTENSIONS or target is None or target == part:
                continue
            if order.index(target) > order.index(part):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({part}) imports {imported} ({target})")
    assert not wrong, f"imports against the order {' < '.join(order)}:\n" + "\n".join(wrong)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_modules_import_each_other_in_a_circle(package: str) -> None:
    modules = modules_of(package)
    graph = {
        name: {m for _, m in module_imports(path, name, modules) if m in modules and m != name}
        for name, path in modules.items()
    }
    assert not circles(graph), f"import circles in {package}: {circles(graph)}"


def test_the_checkers_see_local_relative_and_circular_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from dart_train.trainer import x\n    import dart_infer.decoding\n"
                      "from . import sibling\n")
    assert imported_packages(module, "ngram_builder") == [
        (1, "os"), (4, "dart_train"), (5, "dart_infer"), (6, "ngram_builder"),
    ]
    known = {"dart_infer.tree.settings": module, "dart_infer.tree.search": module}
    assert sorted(module_imports(module, "dart_infer.tree.settings", known)) == [(5, "dart_infer.decoding"), (6, "dart_infer.tree")]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_file_points_outside_the_repository() -> None:
    """A user's clone has no ../shared/: docs and code cite the repository's own files."""
    hits = subprocess.run(["git", "grep", "-n", "shared/reference", "--", ".", ":!tests/test_layout.py"],
                          cwd=ROOT, capture_output=True, text=True)
    assert hits.returncode == 1, f"files citing shared/reference:\n{hits.stdout}"


def test_the_readme_layout_is_short() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0].strip().splitlines()
    assert len(section) <= 15, f"the README's layout section has {len(section)} lines (at most 15)"
