"""What verifying a tree of n nodes costs, relative to one autoregressive step, on this machine.

DART pays one target forward over the whole tree per step, so its speedup is about τ divided by this
ratio (plus the draft's share). On a GPU the ratio stays near 1 up to ~60 nodes; on a CPU it grows
as soon as the forward turns compute-bound, which is why `dart-eval action=fit_tree` sizes the tree.

    python scripts/bench_verify.py --context 300 --nodes 1 2 4 8 12 16 24 32
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from dart_infer.data.assets import resolve_model
from dart_infer.target.adapter import TargetModel
from dart_infer.target.step_cost import use_fast_matmul_layout


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the tree")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--default-layout", action="store_true",
                        help="keep transformers' weight layout (DartModel serves with use_fast_matmul_layout)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(args.model), dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).eval()
    if not args.default_layout:
        use_fast_matmul_layout(model)  # what DartModel serves with
    target = TargetModel(model)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (1, args.context), generator=generator)
    _, _, cache = target.prefill(prompt)
    past = cache.get_seq_length()

    def rewind() -> None:  # back to the prompt-only cache, so every repeat sees the same context
        target.keep_path(cache, past, [])

    def ar_step() -> None:
        target.next_logits(torch.tensor([[1]]), cache)
        rewind()

    base = best_of(ar_step, args.repeats)
    layout = "transformers' layout" if args.default_layout else "serving layout"
    print(f"{args.model} ({args.dtype}, {layout}, {torch.get_num_threads()} threads), {past} cached tokens: "
          f"one AR step {base * 1e3:.1f} ms\n")
    print("| tree nodes | verify ms | × AR step |\n|---|---|---|")
    for n in args.nodes:
        tokens = torch.randint(0, target.vocab_size, (n,), generator=generator)
        # A chain is as costly as any tree of n nodes: the forward's cost depends on n, not the shape.
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))

        def verify(tokens=tokens, mask=mask) -> None:
            target.verify(tokens, torch.arange(tokens.numel()), mask, cache)
            rewind()

        seconds = best_of(verify, args.repeats)
        print(f"| {n} | {seconds * 1e3:.1f} | {seconds / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
