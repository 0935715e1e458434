"""The memory allocator the `dart-*` console scripts run under: tcmalloc where it is installed.

Why: PyTorch's CPU tensors come from malloc, and glibc hands every freed block above its mmap
threshold (32 MB at most; a training step's logits alone are ~400 MB) back to the kernel, so the
next step faults all of its pages in again — 75,000 page faults/s and ~14% of a training step's CPU
time spent in the kernel on a 2-core EPYC. tcmalloc keeps freed memory for reuse: a DART training
step ran 1.23x faster there (`python scripts/bench_allocator.py`). An allocator has to be in place
before the interpreter starts (LD_PRELOAD), so a console script re-executes itself once with it.
`make venv` installs it (Debian: libtcmalloc-minimal4).

`DART_ALLOCATOR`: `auto` (default: tcmalloc if found, else glibc's malloc), `system` (glibc's
malloc, no re-exec), or the path of an allocator library to preload instead.

API: `use_fast_allocator()` (called first by every console script), `allocator_in_use()`,
`describe_allocator()` (the line the scripts print), `find_tcmalloc()`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "DART_ALLOCATOR"
_REEXECUTED = "_DART_ALLOCATOR_REEXECUTED"  # set in the re-executed process: never loop
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                "/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """Path of an installed tcmalloc, or None."""
    for directory in LIBRARY_DIRS:
        for name in TCMALLOC_NAMES:
            path = Path(directory) / name
            if path.is_file():
                return str(path)
    return None


def allocator_in_use() -> str:
    """`tcmalloc`, `jemalloc` or `glibc`: which malloc this process runs with (from its memory map)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc"


def describe_allocator() -> str:
    """One line for a script's log: the allocator in use and how to change it."""
    name = allocator_in_use()
    if name != "glibc":
        return f"allocator: {name} ({ENV}=system for glibc's malloc)"
    if os.environ.get(ENV, "auto").strip() == "system":
        return f"allocator: glibc ({ENV}=system)"
    if find_tcmalloc():
        return "allocator: glibc (tcmalloc is preloaded only for the dart-* console scripts)"
    return ("allocator: glibc (no tcmalloc found: `apt-get install libtcmalloc-minimal4` makes CPU training "
            "steps ~1.2x faster)")


def use_fast_allocator() -> None:
    """Re-execute this console script once with tcmalloc preloaded (see the module docstring).

    Does nothing outside Linux, for `DART_ALLOCATOR=system`, when a non-glibc allocator is already
    loaded, or when the process was not started as a `dart-*` console script (an in-process call
    from Python or pytest is never replaced).
    """
    choice = os.environ.get(ENV, "auto").strip() or "auto"
    if sys.platform != "linux" or choice == "system" or os.environ.get(_REEXECUTED):
        return
    script = sys.argv[0] if sys.argv else ""
    if not (Path(script).name.startswith("dart-") and Path(script).is_file()):
        return
    if choice == "auto":
        library = find_tcmalloc()
        if library is None:
            return
    else:
        library = choice
        if not Path(library).is_file():
            raise FileNotFoundError(f"{ENV}={choice!r}: no such file (use auto, system or an allocator .so path)")
    if allocator_in_use() not in ("glibc", "unknown"):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    env[_REEXECUTED] = "1"
    # gperftools prints a line for every allocation above 1 GB; offline state precompute makes some.
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, script, *sys.argv[1:]], env)
