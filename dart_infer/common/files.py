"""Files that are either complete or absent, and their sha256 digests.

One scheme for every cache the project writes (converted models, offline target states, tokenized
data): write under a temporary name next to the destination, flush it to disk, then rename it into
place (`os.replace` is atomic on POSIX within one file system), so a killed process leaves either
the old file or the new one, never a half-written one; the temporary file is removed on error.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_directory", "atomic_path", "atomic_write_bytes", "sha256_file"]


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 digest of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path` for the caller to write (any writer: `torch.save`,
    safetensors, ...); on a normal exit it is fsynced and renamed onto `path`, on an error removed.
    Anything computed from the temporary file inside the block (e.g. its digest) describes `path`."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` atomically (see `atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


@contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty staging directory next to `path`; on a normal exit it replaces `path` (an
    existing directory there is removed first), on an error it is removed."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield staging
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
