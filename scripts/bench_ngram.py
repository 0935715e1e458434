"""Benchmark the n-gram trie against the original DART trie's measured numbers (anchors.md).

ShareGPT train split, SmolLM2 tokenizer, order 3. Prints a markdown table:
bytes/node on disk and in RAM, load time, µs per 25-candidate query (single, batched; for the
default memory-mapped load and for `mmap=False`, timed interleaved), build throughput and peak RSS
(counting from token ids, in a child process), tokenization time.

    python scripts/bench_ngram.py [--out runs/bench_ngram] [--limit N] [--reuse-ids]
    python scripts/bench_ngram.py --query-only [--trie runs/ngram/sharegpt/full.ngt]  # queries only
    python scripts/bench_ngram.py --query-only --baseline-so OLD/_core.cpython-*.so  # + an older build
    python scripts/bench_ngram.py --query-only --breakdown  # where a query's time goes

With --baseline-so, an older build of ngram_builder._core (a copy of its .so) answers the same
queries in the same process, interleaved with this build, so that a shared machine's load affects
both alike; its answers must be identical.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# The original DART C++ code, measured on a 2-core Xeon (docs/results/measured.md, "original DART").
ANCHOR = {
    "nodes": 9_275_303,
    "disk_bytes_per_node": 36.0,
    "ram_bytes_per_node": 80.0,
    "load_s": 3.85,
    "query_us": 3.5,
    "build_tok_s": 2.1e6,
    "build_peak_mb": 1900.0,
    "tokenize_s": 22.0,
}


def tokenize(out: Path, limit: int | None) -> dict:
    from dart_infer.data.assets import tokenizer_fingerprint
    from dart_infer.data.conversations import load_conversations
    from dart_infer.data.loaders import load_tokenizer
    from ngram_builder.build import _flatten

    tok = load_tokenizer("smollm2-135m-instruct")
    convs = load_conversations("sharegpt", split="train", limit=limit)
    texts = ["\n".join(m["content"] for m in c.messages) for c in convs]
    t0 = time.perf_counter()
    ids: list[list[int]] = []
    for i in range(0, len(texts), 256):
        ids.extend(tok(texts[i : i + 256], add_special_tokens=False)["input_ids"])
    tok_s = time.perf_counter() - t0
    flat, offsets = _flatten(ids, tok.eos_token_id)
    np.savez(out / "ids.npz", flat=flat, offsets=offsets)
    meta = {"docs": len(texts), "tokens": int(len(flat)), "tokenize_s": tok_s, "vocab_size": len(tok),
            "fingerprint": tokenizer_fingerprint(tok)}
    (out / "ids.json").write_text(json.dumps(meta))
    return meta


def vm_hwm_mb() -> float:
    """Peak RSS of this process image (VmHWM; unlike ru_maxrss it does not inherit the parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_build(out: Path, memory_cap_mb: float, threads: int, target: str) -> None:
    """Runs in a fresh process so that ru_maxrss is the build's own peak."""
    from ngram_builder import NgramTrie, _core

    meta = json.loads((out / "ids.json").read_text())
    data = np.load(out / "ids.npz")
    flat, offsets = data["flat"], data["offsets"]
    base_rss = vm_hwm_mb()
    spill = out / "spill"
    spill.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    c0 = time.process_time()
    counter = _core.SliceCounter(3, meta["vocab_size"], int(memory_cap_mb * 2**20),
                                 str(spill) if memory_cap_mb else "", threads)
    step = 2048
    for i in range(0, len(offsets) - 1, step):
        j = min(i + step, len(offsets) - 1)
        counter.add_flat(flat[offsets[i] : offsets[j]], offsets[i : j + 1] - offsets[i])
    t_count = time.perf_counter() - t0
    if memory_cap_mb:
        counter.build(target, meta["fingerprint"])
    else:
        trie = NgramTrie._wrap(counter.build("", meta["fingerprint"]))
        trie.save(target, overwrite=True)
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    peak = vm_hwm_mb()
    print(json.dumps({"count_s": t_count, "total_s": total, "cpu_s": cpu, "peak_mb": peak, "input_mb": base_rss,
                      "ids_mb": (flat.nbytes + offsets.nbytes) / 2**20}))


def run_child(out: Path, cap: float, threads: int, target: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", str(out), str(cap), str(threads), str(target)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def query_set(flat: np.ndarray, offsets: np.ndarray, n: int = 20_000) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    # Contexts: 2 consecutive corpus tokens inside one document; candidates: the true next token +
    # 24 tokens drawn from the corpus (unigram-distributed), as a drafter's top-k would look.
    doc = rng.integers(0, len(offsets) - 1, size=n * 2)
    lens = offsets[doc + 1] - offsets[doc]
    doc = doc[lens >= 4][:n]
    pos = offsets[doc] + (rng.random(len(doc)) * (offsets[doc + 1] - offsets[doc] - 3)).astype(np.int64)
    ctx = np.stack([flat[pos], flat[pos + 1]], axis=1).astype(np.int32)
    cand = flat[rng.integers(0, len(flat), size=(len(doc), 25))].astype(np.int32)
    cand[:, 0] = flat[pos + 2]
    return ctx, cand


def load_core(so_path: str):
    """An older build of ngram_builder._core from a copy of its shared object."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_ngram_builder._core", so_path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {so_path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def anon_huge_bytes() -> int:
    """Bytes of this process's anonymous memory in transparent huge pages (0 where unknown)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def query_bench(path: Path, flat: np.ndarray, offsets: np.ndarray, n: int = 20_000,
                baseline_so: str | None = None, passes: int = 5) -> dict:
    """Single and batched query times of the trie memory-mapped (the default load) and read into
    memory (`mmap=False`: huge pages + candidate index), and of an older build when given: all
    timed interleaved in each pass, so load on the shared machine affects them alike. Keys:
    single/batched (mmap), mem_* (mmap=False), baseline_* and the medians of per-pass ratios."""
    from ngram_builder import NgramTrie

    trie = NgramTrie.load(path)
    huge_before = anon_huge_bytes()
    trie_mem = NgramTrie.load(path, mmap=False)
    huge_granted = (anon_huge_bytes() - huge_before) / path.stat().st_size
    ctx, cand = query_set(flat, offsets, n)
    # Each pass walks 20k random contexts over a trie larger than the caches, so misses dominate;
    # the minimum over passes drops passes disturbed by other jobs on the shared machine.
    # Single: one probability() call per query in a C++ loop; batched: one probability_batch()
    # call for all of them (one thread), both measured in C++.
    contenders = {"mmap": trie._t, "mem": trie_mem._t}
    if baseline_so:
        contenders["baseline"] = load_core(baseline_so).Trie.load(str(path))
    reference = trie._t.probability_array(ctx, None, cand)
    for name, t in contenders.items():
        p, m = t.probability_array(ctx, None, cand)
        if not (np.array_equal(m, reference[1]) and np.array_equal(p.view(np.int32), reference[0].view(np.int32))):
            raise SystemExit(f"the {name} trie answers differently")
    single: dict[str, list] = {k: [] for k in contenders}
    batched: dict[str, list] = {k: [] for k in contenders}
    for _ in range(passes):
        for name, t in contenders.items():
            single[name].append(t.bench_queries(ctx, cand, 3))
            with contextlib.suppress(TypeError):  # builds before the batched query path lack it
                batched[name].append(t.bench_queries(ctx, cand, 3, True))
    batch_wall, batch_cpu = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        trie.probability_batch(ctx, cand)
        batch_wall.append((time.perf_counter() - t0) / len(ctx) * 1e6)
        batch_cpu.append((time.process_time() - c0) / len(ctx) * 1e6)
    ctx_l, cand_l = ctx.tolist(), cand.tolist()
    t0, c0 = time.perf_counter(), time.process_time()
    for c, k in zip(ctx_l[:5000], cand_l[:5000], strict=True):
        trie.probability(c, k)
    py_us = (time.perf_counter() - t0) / 5000 * 1e6
    py_cpu_us = (time.process_time() - c0) / 5000 * 1e6
    p, m = trie.probability_batch(ctx, cand)
    # The memory system the queries ran on (DRAM latency varies 2x between machines), so a query's
    # time can be read in units of dependent cache misses.
    from ngram_builder import _core

    dram_dep_ns, dram_ind_ns = _core.bench_memory(256.0)
    out = {"dram_dependent_ns": dram_dep_ns, "dram_independent_ns": dram_ind_ns,
           "batch_us": min(batch_wall), "batch_cpu_us": min(batch_cpu), "python_call_us": py_us,
           "python_call_cpu_us": py_cpu_us, "hit_rate_true_next": float((m[:, 0] > 0).mean()),
           "matched_sum": int(m.sum()), "prob_sum": float(p.astype(np.float64).sum()), "queries": len(ctx),
           "huge_pages_granted": huge_granted, "candidate_index_bytes": trie_mem.info()["candidate_index_bytes"],
           "mem_ram_bytes": trie_mem.nbytes}
    # Times in ns (wall, thread CPU) per query -> µs; minimum over passes.
    for name, prefix in (("mmap", ""), ("mem", "mem_"), ("baseline", "baseline_")):
        if single.get(name):
            out[f"{prefix}single_us"] = min(r[0] for r in single[name]) / 1000
            out[f"{prefix}single_cpu_us"] = min(r[1] for r in single[name]) / 1000
        if batched.get(name):
            out[f"{prefix}batched_cpp_us"] = min(r[0] for r in batched[name]) / 1000
            out[f"{prefix}batched_cpp_cpu_us"] = min(r[1] for r in batched[name]) / 1000
    # Each pass times all of them back to back: the median of the per-pass ratios is robust to load
    # that changes between passes.
    def median_ratio(a: str, b: str) -> float:
        return statistics.median(x[1] / y[1] for x, y in zip(single[a], single[b], strict=True))

    out["single_ratio_mem_to_mmap"] = median_ratio("mem", "mmap")
    if single.get("baseline"):
        out["single_ratio_to_baseline"] = median_ratio("mmap", "baseline")
    return out


def query_only(out: Path, trie_path: Path, baseline_so: str | None, passes: int) -> None:
    """Only the query numbers, on an existing trie and the cached ids (tokenized by a full run)."""
    data = np.load(out / "ids.npz")
    q = query_bench(trie_path, data["flat"], data["offsets"], baseline_so=baseline_so, passes=passes)
    print(f"trie {trie_path}; machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for prefix, what in (("", "memory-mapped (default load)"), ("mem_", "read into memory (mmap=False)")):
        print(f"{what}: single (C++ loop) {q[prefix + 'single_us']:.3f} µs wall, {q[prefix + 'single_cpu_us']:.3f} µs "
              f"CPU per 25-candidate query; batched (one C++ call, one thread) {q[prefix + 'batched_cpp_us']:.3f} µs "
              f"wall, {q[prefix + 'batched_cpp_cpu_us']:.3f} µs CPU per query")
    print(f"mmap=False / mmap, median of per-pass single-query ratios: {q['single_ratio_mem_to_mmap']:.3f} "
          f"({q['huge_pages_granted']:.0%} of the file in huge pages, 0% where transparent huge pages are off; "
          f"candidate index {q['candidate_index_bytes'] / 2**20:.1f} MiB)")
    if "baseline_single_cpu_us" in q:
        extra = (f", batched {q['baseline_batched_cpp_cpu_us']:.3f} µs CPU"
                 if "baseline_batched_cpp_cpu_us" in q else "")
        print(f"baseline build (memory-mapped), same queries, interleaved: single {q['baseline_single_cpu_us']:.3f} "
              f"µs CPU{extra}; this build (memory-mapped) / baseline, median of per-pass ratios: "
              f"{q['single_ratio_to_baseline']:.3f}")
    print(f"batched from Python (numpy; threads for >= 2048 rows): {q['batch_us']:.3f} µs wall, "
          f"{q['batch_cpu_us']:.3f} µs CPU per query")
    print(f"single Python call: {q['python_call_us']:.3f} µs wall, {q['python_call_cpu_us']:.3f} µs CPU")
    print(f"true next token found: {q['hit_rate_true_next']:.3f}; checksums matched={q['matched_sum']} "
          f"probs={q['prob_sum']:.6f}")
    print(memory_line(q))


def memory_line(q: dict) -> str:
    return (f"{q['dram_dependent_ns']:.0f} ns per dependent DRAM read (pointer chase, 256 MiB), "
            f"{q['dram_independent_ns']:.1f} ns per independent read; a single query takes as long as "
            f"{q['single_cpu_us'] * 1000 / q['dram_dependent_ns']:.1f} dependent reads")


def query_breakdown(out: Path, trie_path: Path, passes: int) -> None:
    """Where a query's time goes: the same queries with parts removed, timed interleaved in one
    process (minimum over passes, thread CPU time), for the default load and for mmap=False. The
    2-token part is the chain slot -> level-2 node -> level-3 run; the 1-token part is 25
    independent hash, index or run lookups."""
    from ngram_builder import _core

    data = np.load(out / "ids.npz")
    ctx, cand = query_set(data["flat"], data["offsets"])
    loads = {"mmap": _core.Trie.load(str(trie_path)), "mmap=False": _core.Trie.load(str(trie_path), False, True)}
    uniform = cand.copy()
    uniform[:, 1:] = np.random.default_rng(1).integers(0, loads["mmap"].info()["vocab_size"], size=(len(cand), 24))
    variants = {
        "full query (2-token context, 25 candidates)": (ctx, cand, 2),
        "2-token context, 1 candidate": (ctx, cand[:, :1], 2),
        "1-token context, 25 candidates": (ctx[:, 1:], cand, 2),
        "1-token context, 25 uniform candidates (mostly absent)": (ctx[:, 1:], uniform, 2),
        "1-token context, 1 candidate": (ctx[:, 1:], cand[:, :1], 2),
        "full query, 200 queries repeated (cache-resident)": (ctx[:200], cand[:200], 100),
    }
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(passes):
        for name, (c, k, repeats) in variants.items():
            c, k = np.ascontiguousarray(c), np.ascontiguousarray(k)
            for load, trie in loads.items():
                times.setdefault((name, load), []).append(trie.bench_queries(c, k, repeats)[1] / 1000)
    dep_ns, ind_ns = _core.bench_memory(256.0)
    print(f"trie {trie_path}; {dep_ns:.0f} ns per dependent DRAM read, {ind_ns:.1f} ns per independent read")
    print(f"{'µs CPU per query':58s} {'mmap':>8s} {'mmap=False':>11s}")
    for name in variants:
        print(f"{name:58s} {min(times[name, 'mmap']):8.3f} {min(times[name, 'mmap=False']):11.3f}")


def load_bench(path: Path, repeats: int = 20, mmap: bool = True) -> float:
    from ngram_builder import NgramTrie

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t = NgramTrie.load(path, mmap=mmap)
        t.probability([1, 2], [3])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_build(Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench_ngram")
    ap.add_argument("--limit", type=int, default=None, help="conversations (default: the whole train split)")
    ap.add_argument("--reuse-ids", action="store_true", help="reuse tokenized ids from a previous run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cap-mb", type=float, default=256, help="memory cap of the external-merge build")
    ap.add_argument("--query-only", action="store_true",
                    help="only time queries on --trie (needs ids.npz from an earlier run in --out)")
    ap.add_argument("--trie", default="runs/ngram/sharegpt/full.ngt", help="trie for --query-only")
    ap.add_argument("--baseline-so", default=None,
                    help="with --query-only: also time this copy of an older _core build (same process)")
    ap.add_argument("--passes", type=int, default=5, help="with --query-only: timed passes (minimum reported)")
    ap.add_argument("--breakdown", action="store_true",
                    help="with --query-only: time the query with parts removed (where the time goes)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.query_only and args.breakdown:
        query_breakdown(out, Path(args.trie), args.passes)
        return
    if args.query_only:
        query_only(out, Path(args.trie), args.baseline_so, args.passes)
        return
    out.mkdir(parents=True, exist_ok=True)
    if args.reuse_ids and (out / "ids.json").exists():
        meta = json.loads((out / "ids.json").read_text())
    else:
        meta = tokenize(out, args.limit)
    print(f"corpus: {meta['docs']:,} conversations, {meta['tokens']:,} tokens; tokenization {meta['tokenize_s']:.1f} s",
          flush=True)

    full = out / "sharegpt.ngt"
    mem = run_child(out, 0, args.threads, full)
    capped_path = out / "sharegpt_capped.ngt"
    cap = run_child(out, args.cap_mb, args.threads, capped_path)
    identical = full.read_bytes() == capped_path.read_bytes()
    capped_path.unlink()

    from ngram_builder import NgramTrie

    trie = NgramTrie.load(full, verify=True)
    nodes = trie.num_nodes
    disk = full.stat().st_size
    ram = trie.nbytes
    dart_path = out / "sharegpt.trie"
    trie.save_dart(dart_path, overwrite=True)
    t0 = time.perf_counter()
    NgramTrie.load_dart(dart_path)
    load_dart_s = time.perf_counter() - t0
    dart_bytes = dart_path.stat().st_size
    dart_path.unlink()
    load_s = load_bench(full)
    load_mem_s = load_bench(full, mmap=False)
    data = np.load(out / "ids.npz")
    q = query_bench(full, data["flat"], data["offsets"])
    tok_s = meta["tokens"] / mem["total_s"]

    rows = [
        ("nodes", f"{ANCHOR['nodes']:,} (all conversations)", f"{nodes:,} (train split)"),
        ("bytes/node on disk", f"{ANCHOR['disk_bytes_per_node']:.0f}", f"{disk / nodes:.2f} ({disk / 2**20:.1f} MiB)"),
        ("bytes/node in RAM", f"~{ANCHOR['ram_bytes_per_node']:.0f}",
         f"{ram / nodes:.2f} (mmap + level-1 index); {q['mem_ram_bytes'] / nodes:.2f} with mmap=False"),
        ("load", f"{ANCHOR['load_s']:.2f} s", f"{load_s * 1e3:.2f} ms (mmap; header + table checks); "
         f"{load_mem_s * 1e3:.1f} ms with mmap=False (a copy + candidate index)"),
        ("query, 2-token ctx, 25 cand.", f"{ANCHOR['query_us']:.1f} µs",
         f"{q['single_us']:.2f} µs wall / {q['single_cpu_us']:.2f} µs CPU (C++ call); "
         f"{q['batched_cpp_cpu_us']:.2f} µs CPU per query in one C++ batch call; "
         f"mmap=False: {q['mem_single_cpu_us']:.2f} µs CPU single, {q['mem_batched_cpp_cpu_us']:.2f} µs CPU "
         f"batched (per-pass ratio to mmap {q['single_ratio_mem_to_mmap']:.3f}); "
         f"{q['batch_us']:.2f} µs wall / {q['batch_cpu_us']:.2f} µs CPU per query batched from Python; "
         f"{q['python_call_us']:.1f} µs single Python call"),
        ("memory system (this machine)", "-", memory_line(q)),
        ("build (ids -> trie file)", f"{ANCHOR['build_tok_s'] / 1e6:.1f} M tok/s, peak {ANCHOR['build_peak_mb']:.0f} MB",
         f"{tok_s / 1e6:.2f} M tok/s ({mem['total_s']:.1f} s wall, {mem['cpu_s']:.1f} s CPU, {args.threads} threads), "
         f"peak RSS {mem['peak_mb']:.0f} MB (incl. ids {mem['ids_mb']:.0f} MB + interpreter/numpy {mem['input_mb']:.0f} MB)"),
        (f"build under {args.cap_mb:.0f} MB cap", "-",
         f"{meta['tokens'] / cap['total_s'] / 1e6:.2f} M tok/s, peak RSS {cap['peak_mb']:.0f} MB, "
         f"byte-identical: {identical}"),
        ("tokenization (HF fast, batch 256)", f"{ANCHOR['tokenize_s']:.0f} s",
         f"{meta['tokenize_s']:.1f} s ({meta['tokens'] / meta['tokenize_s'] / 1e6:.2f} M tok/s)"),
        ("original .trie written by us", "36 bytes/node", f"{dart_bytes / nodes:.1f} bytes/node, load_dart {load_dart_s:.2f} s"),
    ]
    print(f"\nmachine load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| what | original DART | ngram_builder |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    result = {"meta": meta, "nodes": nodes, "disk_bytes": disk, "ram_bytes": ram, "load_s": load_s,
              "load_in_memory_s": load_mem_s, "query": q,
              "build": mem, "build_capped": cap, "capped_identical": identical, "dart_bytes": dart_bytes,
              "load_dart_s": load_dart_s, "info": trie.info()}
    (out / "bench.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
