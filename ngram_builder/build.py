"""Building tries from corpora: text sources, batched tokenization, parallel C++ counting, outputs.

The library takes documents as text from any iterable and a function that turns a batch of texts
into token ids; it knows no model, tokenizer or conversation format. The `dart-ngram` app
(`dart_infer.cli.ngram`) wires the configured sources, the model's tokenizer and its fingerprint
string into `build_tries`.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import random
import resource
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import _core
from .trie import NgramTrie

log = logging.getLogger(__name__)

#: Directories never walked in source trees.
SKIP_DIRS = {".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", "build", "dist", ".tox"}


class MalformedLineError(ValueError):
    """A JSONL line that is not valid JSON or lacks the text field."""


@dataclass
class CorpusSource:
    """A named stream of documents with a sampling weight and an optional document cap.

    `weight` w counts every document floor(w) times plus once more with probability w - floor(w)
    (seeded), so 0.5 samples half the documents and 2 doubles a source's influence.
    """

    name: str
    texts: Callable[[], Iterable[str]]
    weight: float = 1.0
    max_docs: int | None = None

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"source {self.name!r}: weight must be >= 0, got {self.weight}")
        if self.max_docs is not None and self.max_docs < 0:
            raise ValueError(f"source {self.name!r}: max_docs must be >= 0, got {self.max_docs}")


# ------------------------------------------------------------------------------------------ sources

def _field(row: Any, dotted: str) -> Any:
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def jsonl_texts(path: str | os.PathLike[str], text_field: str = "text", *, skip_malformed: bool = False) -> Iterator[str]:
    """Documents from a JSONL file (`text_field` may be dotted, e.g. `meta.body`)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"JSONL source not found: {p}")
    with p.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = _field(row, text_field)
                if not isinstance(text, str):
                    raise TypeError(f"field {text_field!r} is {type(text).__name__}, not a string")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                if skip_malformed:
                    log.warning("skipping malformed line %s:%d (%s)", p, lineno, e)
                    continue
                raise MalformedLineError(f"{p}:{lineno}: malformed JSONL line ({type(e).__name__}: {e})") from e
            yield text


def text_file_texts(pattern: str | os.PathLike[str], *, split: str = "file") -> Iterator[str]:
    """Plain text files (a path or a glob); one document per file, line or blank-line paragraph."""
    if split not in ("file", "line", "paragraph"):
        raise ValueError(f"split must be 'file', 'line' or 'paragraph', got {split!r}")
    pat = str(pattern)
    paths = sorted(Path().glob(pat)) if any(c in pat for c in "*?[") else [Path(pat)]
    if not paths or not all(p.exists() for p in paths):
        raise FileNotFoundError(f"text source not found: {pat}")
    for p in paths:
        if p.is_dir():
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        if split == "file":
            yield text
        elif split == "line":
            yield from (line for line in text.splitlines() if line.strip())
        else:
            yield from (para for para in text.split("\n\n") if para.strip())


def source_tree_texts(root: str | os.PathLike[str], include: Iterable[str] = ("*.py",),
                      max_file_bytes: int = 1 << 20) -> Iterator[str]:
    """Every file under `root` matching one of the `include` globs (one document per file)."""
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"source tree not found: {base}")
    patterns = list(include)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not any(fnmatch.fnmatch(name, pat) for pat in patterns):
                continue
            p = Path(dirpath) / name
            try:
                if p.stat().st_size > max_file_bytes:
                    continue
                yield p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError) as e:
                log.warning("skipping %s (%s)", p, e)


def hf_dataset_texts(name: str, *, config: str | None = None, split: str = "train", text_field: str = "text",
                     streaming: bool = True, **kwargs: Any) -> Iterator[str]:
    """Any `datasets.load_dataset` dataset (streamed by default, so it may exceed RAM and disk)."""
    import datasets

    ds = datasets.load_dataset(name, config, split=split, streaming=streaming, **kwargs)
    for i, row in enumerate(ds):
        try:
            text = _field(row, text_field)
        except KeyError as e:
            raise MalformedLineError(f"{name}[{i}]: no field {text_field!r}") from e
        if isinstance(text, str):
            yield text


# ------------------------------------------------------------------------------------------- build

@dataclass
class BuildReport:
    order: int
    documents: int = 0
    tokens: int = 0
    tokenize_s: float = 0.0
    count_s: float = 0.0
    merge_write_s: float = 0.0
    prune_s: float = 0.0
    total_s: float = 0.0
    peak_rss_mb: float = 0.0
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_source: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def summary(self) -> str:
        lines = [
            f"documents {self.documents:,}  tokens {self.tokens:,}",
            f"tokenize {self.tokenize_s:.1f} s ({self.tokens / max(self.tokenize_s, 1e-9) / 1e6:.2f} M tok/s)  "
            f"count {self.count_s:.1f} s  merge+write {self.merge_write_s:.1f} s  prune {self.prune_s:.1f} s  "
            f"total {self.total_s:.1f} s  peak RSS {self.peak_rss_mb:.0f} MB",
        ]
        for name, o in self.outputs.items():
            lines.append(f"{name}: {o['path']}  nodes {o['nodes']:,}  {o['bytes']:,} bytes  "
                         f"{o['bytes_per_node']:.2f} bytes/node")
        return "\n".join(lines)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _weighted_docs(source: CorpusSource, seed: int) -> Iterator[str]:
    rng = random.Random(f"{seed}:{source.name}")
    whole = int(source.weight)
    frac = source.weight - whole
    for taken, text in enumerate(source.texts()):
        if source.max_docs is not None and taken >= source.max_docs:
            break
        repeat = whole + (1 if frac > 0 and rng.random() < frac else 0)
        for _ in range(repeat):
            yield text


def _batches(it: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _flatten(ids: Sequence[Sequence[int]], eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    extra = 0 if eos_id is None else 1
    lengths = np.fromiter((len(x) + extra for x in ids), dtype=np.int64, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    for i, x in enumerate(ids):
        start = offsets[i]
        flat[start : start + len(x)] = x
        if extra:
            flat[offsets[i + 1] - 1] = eos_id
    return flat, offsets


def build_tries(
    sources: list[CorpusSource],
    encode: Callable[[list[str]], Sequence[Sequence[int]]],
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int,
    eos_id: int,
    order: int = 3,
    min_count: int = 2,
    fingerprint: str = "",
    memory_cap_mb: float = 0,
    threads: int = 2,
    batch_docs: int = 256,
    write_dart: bool = False,
    overwrite: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> BuildReport:
    """Tokenize `sources` with `encode`, count, and write `full.ngt` and the pruned `small.ngt` (plus
    `full.trie` / `small.trie` in the original format with `write_dart`) into `out_dir`.

    `encode(texts)` returns one list of token ids per text (e.g. a fast tokenizer called on the
    batch); `vocab_size` is the tokenizer's vocabulary size and `fingerprint` its fingerprint string
    (stored in the files, checked when a trie is paired with a model). `eos_id` is appended to every
    document, as in DART. `memory_cap_mb` > 0 bounds the counting buffers: sorted runs and builder
    columns spill to `out_dir/tmp` and merge from disk; the files are byte-identical to an uncapped
    build.
    """
    from tqdm.auto import tqdm

    if not sources:
        raise ValueError("no corpus sources configured")
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    eos = int(eos_id)
    vocab_size = max(int(vocab_size), eos + 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = ["full.ngt", "small.ngt"] + (["full.trie", "small.trie"] if write_dart else [])
    existing = [n for n in names if (out / n).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{out} already holds {existing}; pass overwrite=true to replace them")

    report = BuildReport(order=order)
    t_start = time.perf_counter()
    spill = out / "tmp"
    if memory_cap_mb > 0:
        spill.mkdir(exist_ok=True)
    counter = _core.SliceCounter(order, vocab_size, int(memory_cap_mb * 2**20), str(spill) if memory_cap_mb > 0 else "",
                                 max(1, threads))
    count_time = [0.0]

    def feed(flat: np.ndarray, offsets: np.ndarray) -> None:
        t0 = time.perf_counter()
        counter.add_flat(flat, offsets)
        count_time[0] += time.perf_counter() - t0

    bar = tqdm(total=None, unit="tok", unit_scale=True, desc="tokenize+count", disable=not progress)
    # Counting (C++, GIL released) of batch i overlaps tokenization (Rust, parallel) of batch i+1.
    with ThreadPoolExecutor(1) as pool:
        inflight: Future[None] | None = None
        for source in sources:
            n_docs = n_tok = 0
            for batch in _batches(_weighted_docs(source, seed), batch_docs):
                t0 = time.perf_counter()
                ids = encode(batch)
                flat, offsets = _flatten(ids, eos)
                report.tokenize_s += time.perf_counter() - t0
                if inflight is not None:
                    inflight.result()
                inflight = pool.submit(feed, flat, offsets)
                n_docs += len(batch)
                n_tok += len(flat)
                bar.update(len(flat))
            report.per_source[source.name] = {"documents": n_docs, "tokens": n_tok}
            report.documents += n_docs
            report.tokens += n_tok
        if inflight is not None:
            inflight.result()
    bar.close()
    report.count_s = count_time[0]
    if report.tokens == 0:
        raise ValueError("empty corpus: the configured sources produced no documents")

    t0 = time.perf_counter()
    full_path = out / "full.ngt"
    if memory_cap_mb > 0:
        counter.build(str(full_path), fingerprint)
        full = NgramTrie.load(full_path)
    else:
        full = NgramTrie._wrap(counter.build("", fingerprint))
        full.save(full_path, overwrite=True)
    report.merge_write_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    small_path = out / "small.ngt"
    if memory_cap_mb > 0:
        small = NgramTrie._wrap(full._t.prune(min_count, str(small_path), str(spill)))
    else:
        small = full.prune(min_count)
        small.save(small_path, overwrite=True)
    report.prune_s = time.perf_counter() - t0
    for name, trie, path in (("full", full, full_path), ("small", small, small_path)):
        size = path.stat().st_size
        report.outputs[name] = {"path": str(path), "nodes": trie.num_nodes, "bytes": size,
                                "bytes_per_node": size / trie.num_nodes, "ram_bytes": trie.nbytes}
        if write_dart:
            dpath = out / f"{name}.trie"
            trie.save_dart(dpath, overwrite=True)
            report.outputs[f"{name}_dart"] = {"path": str(dpath), "nodes": trie.num_nodes,
                                              "bytes": dpath.stat().st_size,
                                              "bytes_per_node": dpath.stat().st_size / trie.num_nodes}
    if memory_cap_mb > 0 and spill.is_dir() and not any(spill.iterdir()):
        spill.rmdir()
    report.total_s = time.perf_counter() - t_start
    report.peak_rss_mb = peak_rss_mb()
    (out / "build_report.json").write_text(report.to_json())
    return report
