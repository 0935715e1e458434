"""`vllm serve` under load: plain, prompt lookup, DART and DART with step-back at 1..N concurrent streamed chats.

    # 1. the prompts (in .venv: the project's loaders), once
    .venv/bin/python scripts/make_serving_prompts.py --out docs/results/vllm_concurrency_prompts.json
    # 2. the servers, one after another (in .venv-vllm: imports only vllm, openai and the stdlib)
    scripts/vllm_env.sh python scripts/bench_vllm_concurrency.py run --target ~/.cache/dart/models/smollm2-135m-instruct \
        --prompts docs/results/vllm_concurrency_prompts.json --dart-spec <export>/vllm_speculative_config.json \
        --step-back-spec <export-B>/vllm_speculative_config.json --concurrency 1 4 16 --max-tokens 128 --out runs/conc
    # 3. the plot from the JSON (in .venv: matplotlib)
    .venv/bin/python scripts/bench_vllm_concurrency.py plot runs/conc/concurrency.json --out docs/results/x.png

`run` starts every server first (`scripts/vllm_env.sh vllm serve <target> [--speculative-config ...]`,
fp32 by default, prefix caching off so every level prefills its prompts; idle servers sleep), sends each
one warm-up request, then at each concurrency c, the methods interleaved (a different one first each
round; --repeats rounds, the faster run kept and every run's tokens/s recorded), streams every prompt (`vllm_chat_check.stream_chat`: greedy, `ignore_eos`,
exactly --max-tokens tokens) with c client threads pulling from one queue; at the end it stops every
server (its whole process group; a process still alive after that is reported as a leak). Per method and level:
total tokens/s (all tokens / wall time of the level), per-request latency and time to first token
(p50, p95), vLLM's draft counters, and whether every response equals plain vLLM's token for token
(same level, and plain at the first level). Methods: `plain`; `ngram` (vLLM prompt lookup,
--ngram-tokens, n-grams 2..5); `dart` (--dart-spec without any batch-size schedule: always drafts);
one `dart_b<B>` per --step-back-spec (a dart-export with `--draft-max-batch B`; `dart_trie_b<B>` when
it was exported with `--ngram-model`: the trie-chosen chain). Writes
`concurrency.json`, `concurrency.md` and `outputs.json` (the token ids) under --out; prints ×plain.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


# ------------------------------------------------------------------------------------ servers (.venv-vllm)


def cpu_flags() -> str:
    """What `grep -o -w -E "amx_bf16|avx512_bf16|avx512f|avx2" /proc/cpuinfo | sort -u` prints, on one line."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    found = set(re.findall(r"\b(amx_bf16|avx512_bf16|avx512f|avx2)\b", text))
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return f"{' '.join(sorted(found)) or 'none'} ({model.group(1).strip() if model else 'cpu'}, {os.cpu_count()} cpus)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def spec_counters(metrics: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters in its Prometheus text (summed over label sets)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in metrics.splitlines():
        for name in COUNTERS:
            if line.startswith(f"vllm:spec_decode_{name}_total"):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


class Server:
    """`vllm serve` in its own session (so stopping it reaches the engine processes it starts)."""

    def __init__(self, target: str, spec: dict | None, dtype: str, max_model_len: int, log: Path,
                 extra: list[str]) -> None:
        self.port, self.log_path = _free_port(), log
        command = [str(ROOT / "scripts" / "vllm_env.sh"), "vllm", "serve", target, "--dtype", dtype,
                   "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(self.port),
                   "--seed", "0", "--no-enable-prefix-caching", *extra]
        if spec is not None:
            command += ["--speculative-config", json.dumps(spec)]
        self.log = log.open("w")
        start = time.monotonic()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        while _get(self.url("/health")) is None:
            if self.process.poll() is not None or time.monotonic() - start > 900:
                self.stop()
                raise RuntimeError(f"server did not start; last lines of {log}:\n" + log.read_text()[-3000:])
            time.sleep(1)
        self.start_seconds = time.monotonic() - start

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def counters(self) -> dict[str, float]:
        return spec_counters(_get(self.url("/metrics")) or "")

    def stop(self) -> bool:
        """Stop the server; True when no process of its group is left."""
        self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=90)
        deadline, leaked = time.monotonic() + 30, True
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)  # anything left of its session?
            except ProcessLookupError:
                leaked = False
                break
            time.sleep(0.5)
        if leaked:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
        return not leaked


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in 0..100."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def run_level(client: Any, model: str, prompts: list[dict], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Every prompt once, `concurrency` client threads pulling from one queue (a closed loop)."""
    from vllm_chat_check import stream_chat

    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(prompts)):
        todo.put(i)
    results: list[dict | None] = [None] * len(prompts)
    errors: list[str] = []

    def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = stream_chat(client, model, prompts[i]["messages"], max_tokens)
            except Exception as err:  # noqa: BLE001 - reported with the level, not raised in a thread
                errors.append(f"{prompts[i]['id']}: {type(err).__name__}: {err}")

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    done = [r for r in results if r is not None]
    latency = [r["seconds"]["total"] for r in done]
    first = [r["seconds"]["first_token"] for r in done if r["seconds"]["first_token"] is not None]
    tokens = sum(len(r["token_ids"]) for r in done)
    return {"concurrency": concurrency, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_p50_s": percentile(latency, 50) if latency else None,
            "latency_p95_s": percentile(latency, 95) if latency else None,
            "ttft_p50_s": percentile(first, 50) if first else None, "ttft_p95_s": percentile(first, 95) if first else None,
            "errors": errors, "requests": [{"id": p["id"], "prompt_tokens": len(r["prompt_token_ids"] or []),
                                            "tokens": len(r["token_ids"]), **r["seconds"]} if r else None
                                           for p, r in zip(prompts, results, strict=True)],
            "token_ids": [r["token_ids"] if r else None for r in results]}


def method_specs(args: argparse.Namespace) -> dict[str, dict | None]:
    specs: dict[str, dict | None] = {"plain": None, "ngram": {
        "method": "ngram", "num_speculative_tokens": args.ngram_tokens, "prompt_lookup_min": 2, "prompt_lookup_max": 5}}
    if args.dart_spec:
        dart = json.loads(Path(args.dart_spec).read_text())
        dart.pop(SCHEDULE_KEY, None)  # `dart` always drafts
        specs["dart"] = dart
    for path in args.step_back_spec or []:
        spec = json.loads(Path(path).read_text())
        if SCHEDULE_KEY not in spec:
            raise SystemExit(f"--step-back-spec {path}: no {SCHEDULE_KEY} (export with dart-export --draft-max-batch B)")
        trie = "dart_chain" in json.loads((Path(spec["model"]) / "config.json").read_text())
        specs[f"dart{'_trie' if trie else ''}_b{spec[SCHEDULE_KEY][0][1]}"] = spec
    chosen = args.methods or list(specs)
    missing = [m for m in chosen if m not in specs]
    if missing:
        raise SystemExit(f"--methods {missing}: not available (have {list(specs)}; dart needs --dart-spec)")
    if "plain" not in chosen:
        chosen.insert(0, "plain")  # the reference of every comparison
    return {m: specs[m] for m in chosen}


def run(args: argparse.Namespace) -> int:
    from openai import OpenAI

    sys.path.insert(0, str(ROOT / "scripts"))
    prompts = json.loads(Path(args.prompts).read_text())[: args.limit]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = cpu_flags()
    print(f"CPU flags: {flags}", flush=True)
    report: dict[str, Any] = {"cpu_flags": flags, "target": args.target, "dtype": args.dtype,
                              "max_tokens": args.max_tokens, "prompts": len(prompts), "concurrency": args.concurrency,
                              "repeats": args.repeats, "methods": {},
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    outputs: dict[str, dict[str, list]] = {}
    servers: dict[str, tuple[Server, Any, str]] = {}
    try:
        # Every server first (idle ones sleep on their sockets), then the levels with the methods interleaved.
        for method, spec in method_specs(args).items():
            entry: dict[str, Any] = {"speculative_config": spec, "levels": []}
            report["methods"][method] = entry
            print(f"== {method}: starting the server", flush=True)
            try:
                server = Server(args.target, spec, args.dtype, args.max_model_len, out / f"server_{method}.log",
                                args.server_arg or [])
            except RuntimeError as err:
                entry["error"] = str(err)
                print(err, flush=True)
                continue
            entry["start_s"] = server.start_seconds
            client = OpenAI(base_url=server.url("/v1"), api_key="EMPTY", timeout=900)
            model = client.models.list().data[0].id
            run_level(client, model, prompts[:1], 1, 8)  # warm-up
            servers[method] = (server, client, model)
        for i, c in enumerate(args.concurrency):
            for rep in range(args.repeats):
                names = list(servers)
                shift = (i * args.repeats + rep) % len(names)  # a different method first each round: drift cancels
                for method in names[shift:] + names[:shift]:
                    measure(servers[method], method, c, rep, prompts, args, report["methods"][method], outputs)
    finally:
        for method, (server, _, _) in servers.items():
            report["methods"][method]["clean_exit"] = clean = server.stop()
            print(f"== {method}: server stopped, {'no process left' if clean else 'LEAK: killed what was left'}",
                  flush=True)
    ok = compare(report, outputs)
    (out / "outputs.json").write_text(json.dumps(outputs) + "\n")
    (out / "concurrency.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "concurrency.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return 0 if ok else 1


def measure(server_client: tuple, method: str, c: int, rep: int, prompts: list[dict], args: argparse.Namespace,
            entry: dict[str, Any], outputs: dict[str, dict[str, list]]) -> None:
    """One level of one method; with repeats, the level keeps the faster run (the other one's tokens/s too)."""
    server, client, model = server_client
    before = server.counters()
    try:
        level = run_level(client, model, prompts, c, args.max_tokens)
    except Exception as err:  # noqa: BLE001 - the other methods still run; the exit code says it failed
        entry["error"] = f"{type(err).__name__}: {err}"
        print(f"   {method} c={c} failed: {entry['error']}", flush=True)
        return
    after = server.counters()
    level["spec"] = {k: after[k] - before[k] for k in COUNTERS}
    ids = level.pop("token_ids")
    print(f"  {method:<8} c={c:<3} {level['tokens_per_s']:7.1f} tok/s  p50 {level['latency_p50_s']:.2f} s  "
          f"p95 {level['latency_p95_s']:.2f} s  ttft p50 {level['ttft_p50_s']:.2f} s  "
          f"drafts {level['spec']['num_drafts']:.0f} errors {len(level['errors'])}", flush=True)
    levels = {lv["concurrency"]: lv for lv in entry["levels"]}
    earlier = levels.get(c)
    if earlier is not None:
        runs = [*earlier.pop("tokens_per_s_runs"), level["tokens_per_s"]]
        if outputs[method][str(c)] != ids:
            level["errors"].append("repeats differ in their tokens")
        if level["tokens_per_s"] <= earlier["tokens_per_s"]:
            level = earlier
        level["tokens_per_s_runs"] = runs
        entry["levels"] = [level if lv["concurrency"] == c else lv for lv in entry["levels"]]
    else:
        level["tokens_per_s_runs"] = [level["tokens_per_s"]]
        entry["levels"].append(level)
    outputs.setdefault(method, {})[str(c)] = ids


def compare(report: dict, outputs: dict) -> bool:
    """Mark each level identical-or-not to plain (same level; plain at the first level); add × plain."""
    plain = outputs.get("plain", {})
    first = plain.get(str(report["concurrency"][0]))
    plain_levels = {lv["concurrency"]: lv for lv in report["methods"].get("plain", {}).get("levels", [])}
    ok = True
    for method, entry in report["methods"].items():
        ok &= entry.get("clean_exit", False) and "error" not in entry
        for level in entry["levels"]:
            c = level["concurrency"]
            ids = outputs[method][str(c)]
            same = plain.get(str(c))
            level["identical_to_plain"] = same is not None and ids == same
            level["identical_to_plain_first_level"] = first is not None and ids == first
            level["mismatched_prompts"] = [i for i, (a, b) in enumerate(zip(ids, same or [], strict=False)) if a != b]
            ok &= level["identical_to_plain"] and not level["errors"]
            base = plain_levels.get(c)
            if base:
                level["x_plain_tokens_per_s"] = level["tokens_per_s"] / base["tokens_per_s"]
                level["x_plain_latency_p50"] = level["latency_p50_s"] / base["latency_p50_s"]
    report["all_identical_and_clean"] = bool(ok)
    return bool(ok)


def markdown(report: dict) -> str:
    lines = [f"vLLM serve, {report['prompts']} streamed chats × {report['max_tokens']} tokens, {report['dtype']}, "
             f"greedy; CPU flags: {report['cpu_flags']}; {report['date']}", "",
             "| method | concurrency | tokens/s | × plain | latency p50 s | p95 s | TTFT p50 s | p95 s "
             "| accepted / draft step | = plain |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for method, entry in report["methods"].items():
        if "error" in entry:
            lines.append(f"| {method} | | failed: {entry['error'][:80]} | | | | | | | |")
        for lv in entry["levels"]:
            spec = lv.get("spec", {})
            accepted = (f"{spec['num_accepted_tokens'] / spec['num_drafts']:.2f}" if spec.get("num_drafts") else "–")
            same = "yes" if lv.get("identical_to_plain") else f"**no** ({len(lv.get('mismatched_prompts', []))})"
            cells = [lv["tokens_per_s"], lv.get("x_plain_tokens_per_s"), lv["latency_p50_s"], lv["latency_p95_s"],
                     lv["ttft_p50_s"], lv["ttft_p95_s"]]
            text = " | ".join("–" if v is None else f"{v:.2f}" for v in cells)
            lines.append(f"| {method} | {lv['concurrency']} | {text} | {accepted} | {same} |")
    clean = all(e.get("clean_exit") for e in report["methods"].values() if "start_s" in e)  # servers that started
    lines += ["", f"every server exited with no process left: {'yes' if clean else 'NO'}", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ plot (.venv)


def plot(path: str, out: str) -> None:
    """tokens/s ÷ plain and p50 latency per concurrency, one line per method, from concurrency.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(path).read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method, entry in report["methods"].items():
        levels = entry["levels"]
        cs = [lv["concurrency"] for lv in levels]
        left.plot(cs, [lv.get("x_plain_tokens_per_s", float("nan")) for lv in levels], marker="o", label=method)
        right.plot(cs, [lv["latency_p50_s"] for lv in levels], marker="o", label=method)
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax, title in ((left, "total tokens/s ÷ vLLM plain"), (right, "per-request latency p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["concurrency"], [str(c) for c in report["concurrency"]])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle(f"vllm serve, {report['prompts']} chats × {report['max_tokens']} tokens, {report['dtype']}; "
                 f"{report['cpu_flags']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="start each server and measure (run in .venv-vllm)")
    r.add_argument("--target", required=True, help="the target model directory")
    r.add_argument("--prompts", required=True, help="JSON from the prompts mode: [{id, messages}, ...]")
    r.add_argument("--dart-spec", default=None, help="a DART export's vllm_speculative_config.json")
    r.add_argument("--step-back-spec", action="append", help="an export written with --draft-max-batch B (repeat)")
    r.add_argument("--methods", nargs="+", default=None, help="subset and order (default: all; plain always runs)")
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--repeats", type=int, default=1, help="runs of each level per method (interleaved); the faster is kept")
    r.add_argument("--ngram-tokens", type=int, default=8)
    r.add_argument("--dtype", default="float32")
    r.add_argument("--max-model-len", type=int, default=2048)
    r.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    r.add_argument("--server-arg", action="append", help="one more `vllm serve` argument (repeat), e.g. --enforce-eager")
    r.add_argument("--out", required=True)
    g = sub.add_parser("plot", help="plot concurrency.json (run in .venv)")
    g.add_argument("report")
    g.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.mode == "run":
        sys.exit(run(args))
    else:
        plot(args.report, args.out)


if __name__ == "__main__":
    main()
