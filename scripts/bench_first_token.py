"""Seconds from a fresh process to the first served token with compiled decoding, phase by phase.

Each run is a new Python process (what a user starting a server pays): import, load (base model,
head, trie), the tree fit (`tree=auto`, cached per machine after its first run), `compile_decoding`,
then one MT-Bench chat streamed with DART, timing its first token and the tokens/s after it.
`--runs 2` runs the same command twice over one inductor cache folder: the first is a cold cache
(a new empty folder unless `--cache-dir` is given), the second a warm one.

    python scripts/bench_first_token.py --dtype bfloat16 --runs 2
    python scripts/bench_first_token.py --mode background --runs 2   # first tokens eager while it compiles
    python scripts/bench_first_token.py --dtype float32 --mode eager        # no compilation at all
    python scripts/bench_first_token.py --dtype auto --bf16-weights auto --mode eager   # an AVX2 CPU's default
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(args: argparse.Namespace) -> None:
    """One fresh process: phases as seconds since the parent started it (`--started`)."""
    marks: dict[str, float] = {"python_started": time.time() - args.started}
    from dart_infer import DartModel, compile_decoding
    from dart_infer.data.conversations import chat_prompt, first_turn, load_conversations

    marks["imported"] = time.time() - args.started
    bf16_weights = {"true": True, "false": False}.get(args.bf16_weights, args.bf16_weights)
    model = DartModel.from_pretrained(args.base, args.head, args.trie, dtype=args.dtype, tree=None,
                                      bf16_weights=bf16_weights)
    marks["loaded"] = time.time() - args.started
    if args.tree == "auto":
        model.tree = "auto"
        model.fitted_tree()
    marks["fitted"] = time.time() - args.started
    if args.mode != "eager":
        compile_decoding(model, background=args.mode == "background")
        marks["compiled" if args.mode == "compiled" else "compile_started"] = time.time() - args.started
    ids = chat_prompt(model.tokenizer, first_turn(load_conversations("mtbench", limit=1)[0]))[None]
    first = request(model, ids, args.tokens, args.started)
    marks["first_token"] = first["first_token"]
    result = {"first_request": first}
    if args.mode == "background":
        model.compiling.wait()
        marks["compiled"] = time.time() - args.started
        result["compiled_while_serving"] = model.compiling.error is None
    result["second_request"] = request(model, ids, args.tokens, args.started)  # compiled unless eager
    result.update(marks_s={k: round(v, 2) for k, v in marks.items()}, tree=repr(model.tree),
                  dtype=str(model.target.dtype))
    print("RESULT " + json.dumps(result), flush=True)


def request(model: object, ids: object, tokens: int, started: float) -> dict[str, float]:
    """One greedy DART request, streamed: its first token (s since the process started), tokens/s after."""
    import torch

    count, first_at = 0, None
    with torch.inference_mode():  # as servers call it; the compiled steps must not compile again under it
        for step in model.dart_generate_stream(ids, temperature=0.0, max_new_token_num=tokens):
            count += len(step.tokens)
            first_at = first_at or time.time() - started
    done = time.time() - started
    return {"first_token": round(first_at, 2), "tokens": count,
            "tokens_per_s_after_first": round((count - 1) / max(done - first_at, 1e-9), 1),
            "tau": round(model.last_stats.tau, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="smollm2-135m-instruct")
    parser.add_argument("--head", default="dart-smollm2-135m-instruct")
    parser.add_argument("--trie", default="runs/ngram/sharegpt/full.ngt")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tree", default="auto", help="auto (fitted, cached) or default (the settings' default)")
    parser.add_argument("--bf16-weights", default="false", choices=["false", "true", "auto"],
                        help="float32 over weights read as bf16 (auto: where --dtype auto chose float32 on a CPU "
                        "without bf16 arithmetic; dart_infer.target.bf16_weights)")
    parser.add_argument("--mode", default="compiled", choices=["compiled", "background", "eager"],
                        help="compiled: compile before serving; background: serve eagerly while compiling")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=1, help="fresh processes over one inductor cache folder")
    parser.add_argument("--cache-dir", default=None, help="inductor cache folder (default: a new empty one)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="inductor-cache-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    print(f"inductor cache: {cache_dir} ({'given' if args.cache_dir else 'new, empty'})", flush=True)
    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}"
                 for name in ("base", "head", "trie", "dtype", "tree", "mode", "tokens", "bf16_weights")]
    for run in range(args.runs):
        command = [sys.executable, __file__, "--child", f"--started={time.time()}", *forwarded]
        out = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            sys.exit(f"run {run + 1} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        result = json.loads(lines[-1][len("RESULT "):])
        print(json.dumps({"run": run + 1, "cache": "cold" if run == 0 and not args.cache_dir else "warm",
                          **result}), flush=True)


if __name__ == "__main__":
    main()
