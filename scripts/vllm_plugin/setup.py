"""The two C++ extensions the plugin's trie-chosen chain needs (pyproject.toml says why they are here):
the same sources and flags as CMakeLists.txt's `_search` and `_core`."""

from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import setup

ParallelCompile("DART_BUILD_JOBS").install()  # all cores unless DART_BUILD_JOBS says otherwise

# Absolute paths: relative ones ("../../...") would put the object files beside the sources, not in build/.
ROOT = Path(__file__).resolve().parents[2]
SHARED = str(ROOT / "csrc" / "include")


def sources(package: str) -> list[str]:
    return sorted(str(p) for p in (ROOT / package / "csrc").glob("*.cpp"))


setup(ext_modules=[
    Pybind11Extension("dart_infer._search", sources("dart_infer"), cxx_std=17,
                      include_dirs=[SHARED, str(ROOT / "dart_infer" / "csrc")],
                      extra_compile_args=["-O3", "-ffp-contract=off"]),  # -ffp-contract=off: bit-equal scores
    Pybind11Extension("ngram_builder._core", sources("ngram_builder"), cxx_std=17,
                      include_dirs=[SHARED, str(ROOT / "ngram_builder" / "csrc")],
                      extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"]),
])
