"""Which fp32/bf16 linear kernel reads a decoding step's weights fastest on this CPU.

SmolLM2-135M's MLP shapes (576 -> 1536 -> 576, 30 layers: 212 MB of fp32 weights, more than a CPU
cache holds) at 1, 7 and 17 rows (a plain step, a small and a large verified tree), through: ATen's
`linear` (what eager decoding runs), MKL's packed sgemm (what inductor packs frozen fp32 linears for
by default), oneDNN's packed linear (what it packs bf16 ones for; `dart_infer.target.compiled` sends
fp32 there too) and ATen's bf16 `linear`. Median of `--repeats` passes; GB/s = weight bytes read.

    python scripts/bench_linear.py
    scripts/cpu_isa.sh avx2 python scripts/bench_linear.py     # the kernels an AVX2-only CPU gets
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_step import timed  # scripts/ is on the path when a script runs: its timer, two warm-ups first

F = torch.nn.functional


def kernels(rows: int, fp32: list, bf16: list, hidden: int) -> dict[str, Callable[[], None]]:
    """One pass over every layer's two matmuls through each kernel, on `rows` random rows."""
    mkl = [tuple(torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in pair) for pair in fp32]
    onednn = [tuple(torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in pair) for pair in fp32]
    x32 = torch.randn(rows, hidden)
    x16 = x32.bfloat16()

    def aten_fp32() -> None:
        x = x32
        for up, down in fp32:
            x = F.linear(F.linear(x, up), down) * 1e-2

    def mkl_packed_fp32() -> None:
        x = x32
        for (packed_up, packed_down), (up, down) in zip(mkl, fp32, strict=True):
            x = torch.ops.mkl._mkl_linear(torch.ops.mkl._mkl_linear(x, packed_up, up, None, rows),
                                          packed_down, down, None, rows) * 1e-2

    def onednn_packed_fp32() -> None:
        x = x32
        for packed_up, packed_down in onednn:
            h = torch.ops.mkldnn._linear_pointwise(x, packed_up, None, "none", [], "")
            x = torch.ops.mkldnn._linear_pointwise(h, packed_down, None, "none", [], "") * 1e-2

    def aten_bf16() -> None:
        x = x16
        for up, down in bf16:
            x = F.linear(F.linear(x, up), down) * 1e-2

    return {"ATen fp32": aten_fp32, "MKL packed fp32": mkl_packed_fp32, "oneDNN packed fp32": onednn_packed_fp32,
            "ATen bf16": aten_bf16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 7, 17])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    fp32 = [(torch.randn(args.intermediate, args.hidden), torch.randn(args.hidden, args.intermediate))
            for _ in range(args.layers)]
    bf16 = [(up.bfloat16(), down.bfloat16()) for up, down in fp32]
    weight_bytes = sum(up.numel() + down.numel() for up, down in fp32) * 4
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen {torch.backends.cpu.get_cpu_capability()}; "
          f"{args.layers} x ({args.hidden}->{args.intermediate}->{args.hidden}) = {weight_bytes / 1e6:.0f} MB fp32\n")
    print("| rows | kernel | ms per pass | weights GB/s |\n|---|---|---|---|")
    with torch.inference_mode():
        for rows in args.rows:
            for name, fn in kernels(rows, fp32, bf16, args.hidden).items():
                seconds = timed(fn, args.repeats)[0]  # the median wall time
                size = weight_bytes // 2 if "bf16" in name else weight_bytes
                print(f"| {rows} | {name} | {seconds * 1e3:.2f} | {size / seconds / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
