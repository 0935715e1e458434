"""One layer's attention for a decoding step's few query rows over a cache: torch's SDPA (as our packed-GQA
path calls it: query heads stacked per key/value head, the tree mask repeated) against
`torch.ops.dart.decode_attention` (dart_infer/csrc/kernels/decode_attention.cpp), interleaved, ms per call
(median of rounds) and the ratio. Then a prompt's causal attention with nothing cached (`--prompt`
lengths): SDPA (`is_causal`, grouped-query) against `torch.ops.dart.prefill_attention`
(prefill_attention.cpp), with GFLOP/s. Shapes default to SmolLM2-135M's (9 query heads, 3 key/value
heads, 64 dims); the cache is a strided view, as a cache with spare room is.

    python scripts/bench_decode_attention.py --threads 2 --context 300 1415 3000 --rows 1 5 15 30
    scripts/cpu_isa.sh avx2 python scripts/bench_decode_attention.py     # with AVX2 kernels only
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


def per_call_ms(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA's causal grouped-query attention in the kernel's output layout [1, T, H, D]."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, nargs="+", default=[300, 1415, 3000], help="cached keys")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 15, 30], help="query rows (tree nodes)")
    parser.add_argument("--prompt", type=int, nargs="*", default=[100, 500, 1293, 3000],
                        help="prompt lengths for the causal prompt attention (none: skip it)")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50, help="calls per round and method")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dart_infer.target.kernels import load_kernels

    load_kernels()
    groups, generator = args.heads // args.kv_heads, torch.Generator().manual_seed(0)
    print(f"{args.heads} query / {args.kv_heads} key-value heads x {args.dim}, float32, {torch.get_num_threads()} "
          f"thread(s), torch {torch.__version__}; ms per call, median of {args.rounds} interleaved rounds")
    print("| cached keys | rows | SDPA (packed GQA) | decode kernel | × |\n|---|---|---|---|---|")
    for keys in args.context:
        room = torch.randn(2, 1, args.kv_heads, keys + 64, args.dim, generator=generator)
        key, value = room[0, :, :, :keys], room[1, :, :, :keys]
        for rows in args.rows:
            query = torch.randn(1, args.kv_heads, groups * rows, args.dim, generator=generator)
            mask = torch.zeros(rows, keys)
            mask[:, keys - rows:] = torch.where(torch.rand(rows, rows, generator=generator) < 0.5, 0.0, float("-inf"))
            mask[:, keys - rows:].fill_diagonal_(0.0)
            repeated = mask.repeat(groups, 1)[None, None]
            methods = {
                "sdpa": partial(F.scaled_dot_product_attention, query, key, value, attn_mask=repeated),
                "kernel": partial(torch.ops.dart.decode_attention, query, key, value, mask, args.dim**-0.5),
            }
            torch.testing.assert_close(methods["kernel"](), methods["sdpa"](), rtol=1e-5, atol=1e-5)
            times: dict[str, list[float]] = {name: [] for name in methods}
            for round_ in range(args.rounds):
                for name in (methods if round_ % 2 == 0 else reversed(list(methods))):
                    methods[name]()
                    times[name].append(per_call_ms(methods[name], args.calls))
            sdpa, kernel = statistics.median(times["sdpa"]), statistics.median(times["kernel"])
            print(f"| {keys} | {rows} | {sdpa:.3f} | {kernel:.3f} | {sdpa / kernel:.2f}× |")
    if args.prompt:
        print("\n| prompt tokens | SDPA (causal) | prefill kernel | × | GFLOP/s SDPA / kernel |\n|---|---|---|---|---|")
    for tokens in args.prompt:
        query = torch.randn(1, tokens, args.heads, args.dim, generator=generator).transpose(1, 2)
        room = torch.randn(2, 1, args.kv_heads, tokens + 64, args.dim, generator=generator)
        key, value = room[0, :, :, :tokens], room[1, :, :, :tokens]
        scale = args.dim**-0.5
        methods = {
            "sdpa": partial(causal_sdpa, query, key, value, scale),
            "kernel": partial(torch.ops.dart.prefill_attention, query, key, value, scale),
        }
        torch.testing.assert_close(methods["kernel"](), methods["sdpa"](), rtol=1e-5, atol=1e-5)
        times = {name: [] for name in methods}
        calls = max(1, args.calls * 100 // tokens)
        for round_ in range(args.rounds):
            for name in (methods if round_ % 2 == 0 else reversed(list(methods))):
                methods[name]()
                times[name].append(per_call_ms(methods[name], calls))
        sdpa, kernel = statistics.median(times["sdpa"]), statistics.median(times["kernel"])
        flops = 4 * args.heads * args.dim * tokens * (tokens + 1) / 2  # scores and value sums, causal half
        print(f"| {tokens} | {sdpa:.3f} | {kernel:.3f} | {sdpa / kernel:.2f}× | "
              f"{flops / sdpa / 1e6:.0f} / {flops / kernel / 1e6:.0f} |")


if __name__ == "__main__":
    main()
