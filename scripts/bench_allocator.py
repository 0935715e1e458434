"""glibc's malloc vs tcmalloc for training and decoding, the two run in alternation, process by process.

    python scripts/bench_allocator.py [--rounds 2] [--skip-decode] [--skip-train]

An allocator is fixed when a process starts (LD_PRELOAD), so each measurement is its own process and
the allocators take turns round after round (the machine is noisy: alternation keeps its drift out of
the ratios). Training: `scripts/bench_train.py --only` the online path `dart-train` runs (bf16 target,
packed rows, autocast head, labels-only; eager, no compile time in the numbers), real tokens/s of its
micro-steps. Decoding: AR and DART (shipped head, default trie, the CPU tree, bf16) on MT-Bench first
turns, tokens/s. Prints each run and the tcmalloc/glibc ratios. The console scripts pick tcmalloc
themselves (dart_infer.common.allocator); this script sets LD_PRELOAD explicitly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_VARIANT = "online bf16/packed/autocast/labels"  # what dart-train runs on a CPU, minus compile


def decode_child(prompts: int, new_tokens: int) -> None:
    import torch

    from dart_infer.cli.eval import benchmark_conversations
    from dart_infer.common.allocator import allocator_in_use
    from dart_infer.data.conversations import chat_prompt, first_turn
    from dart_infer.data.resolve import default_trie_path, model_vocabulary, resolve_trie
    from dart_infer.decoding.dart_model import DartModel

    torch.set_num_threads(2)
    base = "smollm2-135m-instruct"
    # The default trie as dart-eval's `ngram_model=auto` takes it (stdout is this child's JSON line only).
    trie = resolve_trie("auto", vocabulary=lambda: model_vocabulary(base), default=default_trie_path()).path
    model = DartModel.from_pretrained(base, "dart-smollm2-135m-instruct", trie, dtype="bfloat16")
    ids = [chat_prompt(model.tokenizer, first_turn(c)) for c in benchmark_conversations("mtbench", prompts)]
    model.ar_generate(ids[0], max_new_token_num=8)  # warm-up
    model.dart_generate(ids[0], max_new_token_num=8)
    totals = {"ar": [0, 0.0], "dart": [0, 0.0]}
    for prompt in ids:
        for kind, generate in (("ar", model.ar_generate), ("dart", model.dart_generate)):
            stats = generate(prompt, max_new_token_num=new_tokens, return_stats=True)[1]
            totals[kind][0] += stats.new_tokens
            totals[kind][1] += stats.wall_time
    print(json.dumps({"allocator": allocator_in_use(), "trie": trie is not None,
                      **{f"{k}_tokens_per_s": n / s for k, (n, s) in totals.items()}}))


def run(preload: str | None, args: list[str]) -> str:
    """Run `python args...` with `preload` as LD_PRELOAD (None: glibc's malloc); its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["DART_ALLOCATOR"] = "system"  # nothing below re-executes itself
    if preload:
        env["LD_PRELOAD"] = preload
        env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] = str(1 << 40)
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{args} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--decode-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode_child:
        decode_child(args.prompts, args.new_tokens)
        return

    from dart_infer.common.allocator import find_tcmalloc

    tcmalloc = find_tcmalloc()
    if tcmalloc is None:
        raise SystemExit("no tcmalloc found: `make venv` installs it (Debian: apt-get install libtcmalloc-minimal4)")
    allocators = {"glibc": None, "tcmalloc": tcmalloc}
    results: dict[str, dict[str, list[float]]] = {name: {} for name in allocators}
    with tempfile.TemporaryDirectory() as tmp:
        train_json = Path(tmp) / "train.json"
        for round_ in range(args.rounds):
            order = list(allocators) if round_ % 2 == 0 else list(reversed(allocators))
            for name in order:
                if not args.skip_train:
                    run(allocators[name], [str(HERE / "bench_train.py"), "--only", TRAIN_VARIANT,
                                           "--conversations", "24", "--steps", str(args.train_steps),
                                           "--max-anchors", "192", "--json", str(train_json)])
                    online = json.loads(train_json.read_text())["online"][TRAIN_VARIANT]
                    results[name].setdefault("train_tokens_per_s", []).append(online["tokens_per_s"])
                    print(f"round {round_} {name:8s} train {online['tokens_per_s']:7.1f} tok/s", flush=True)
                if not args.skip_decode:
                    out = json.loads(run(allocators[name], [__file__, "--decode-child", "--prompts", str(args.prompts),
                                                            "--new-tokens", str(args.new_tokens)]).splitlines()[-1])
                    if out["allocator"] != ("glibc" if allocators[name] is None else "tcmalloc"):
                        raise SystemExit(f"the child ran under {out['allocator']}, not {name}")
                    for key in ("ar_tokens_per_s", "dart_tokens_per_s"):
                        results[name].setdefault(key, []).append(out[key])
                    print(f"round {round_} {name:8s} decode AR {out['ar_tokens_per_s']:5.1f} "
                          f"DART {out['dart_tokens_per_s']:5.1f} tok/s", flush=True)
    summary = {}
    for key in results["glibc"]:
        glibc, fast = statistics.median(results["glibc"][key]), statistics.median(results["tcmalloc"][key])
        summary[key] = {"glibc": glibc, "tcmalloc": fast, "ratio": fast / glibc}
        print(f"{key:20s} glibc {glibc:7.1f}  tcmalloc {fast:7.1f}  = {fast / glibc:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
