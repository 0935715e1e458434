"""The prompt alone: our target's prefill against vLLM plain's, on the same fresh prompts, interleaved.

Each length gets `--rounds` prompts of random token ids; each prompt is prefilled by our served target
(`TargetModel.prefill`, as `dart-eval` serves it: `--bf16-weights` or not) and then sent to vLLM once with
`max_tokens=1` (never twice: vLLM's prefix cache would answer the second time), vLLM's own wall time, its
processes waited idle before the next method runs (`VllmRunner.wait_idle`). Prints medians and ours/vLLM.

    scripts/cpu_isa.sh avx2 .venv/bin/python scripts/bench_prefill.py --bf16-weights --lengths 350 700 1400 2800
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[350, 700, 1400, 2800])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bf16-weights", action="store_true", help="serve float32 with bf16 weights (our AVX2 path)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from dart_infer import DartModel
    from dart_infer.data.assets import resolve_model
    from dart_infer.engines.vllm.runner import VllmRunner

    model = DartModel.from_pretrained(args.model, None, dtype=torch.float32)
    if args.bf16_weights:
        model.use_bf16_weights()
    target = model.target
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(200, target.vocab_size) for _ in range(n)]

    def ours(ids: list[int]) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            target.prefill(torch.tensor([ids]))
            return time.perf_counter() - start

    with VllmRunner(resolve_model(args.model), "float32") as vllm:
        ours(prompt(300)), vllm.generate(prompt(300), 1), vllm.wait_idle()  # first-call costs
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for n in args.lengths:
                times.setdefault(("ours", n), []).append(ours(prompt(n)))
                times.setdefault(("vllm", n), []).append(vllm.generate(prompt(n), 1)[1])
                vllm.wait_idle()
    print(f"{args.model}, float32{' (bf16 weights)' if args.bf16_weights else ''}, {args.threads} threads, "
          f"vLLM {vllm.version}; median of {args.rounds} fresh prompts per length")
    print("| prompt tokens | ours | vLLM plain | ours / vLLM |\n|---|---|---|---|")
    for n in args.lengths:
        a, b = statistics.median(times[("ours", n)]), statistics.median(times[("vllm", n)])
        print(f"| {n} | {a:.3f} s | {b:.3f} s | {a / b:.2f} |")


if __name__ == "__main__":
    main()
