"""vLLM greedy decoding with and without an exported draft head, on the same prompts (run it in .venv-vllm).

    scripts/vllm_env.sh python scripts/vllm_greedy_check.py --target <target dir> \
        --speculative-config <export>/vllm_speculative_config.json --out check.json

Writes JSON: the token ids vLLM emits for every prompt plainly (`plain`) and with speculative
decoding (`spec`), whether they are equal (`identical`), vLLM's speculative-decoding counters
(`metrics`: drafts, draft tokens, accepted tokens, accepted per position) and timings. Greedy
speculative decoding is lossless, so in float32 `identical` must be true (tests/test_export.py runs
this on a tiny random target). Imports only vllm (no dart_* module): vLLM's venv has other pins.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]


def generate(target: str, prompts: list[str | list[int]], max_tokens: int, dtype: str,
             speculative_config: dict[str, Any] | None, enforce_eager: bool) -> tuple[list[list[int]], dict, float]:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=target, dtype=dtype, speculative_config=speculative_config, seed=0,
              enforce_eager=enforce_eager, disable_log_stats=False, max_model_len=512)
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Token-id prompts skip tokenization: both sides of a comparison see exactly the same ids.
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    metrics: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "value", None)
            metrics[metric.name.removeprefix("vllm:spec_decode_")] = value if value is not None else metric.values
    # Two engines in one process: stop this one (its worker process) before the next starts.
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()
    return tokens, metrics, load_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--speculative-config", required=True, help="an export's vllm_speculative_config.json")
    parser.add_argument("--prompts", default=None, help="JSON file: a list of prompts (strings, or lists of token ids)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="float32: the exactness mode (bf16 rounds differently)")
    parser.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile (faster start)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else DEFAULT_PROMPTS
    spec_config = json.loads(Path(args.speculative_config).read_text())
    started = time.perf_counter()
    plain, _, plain_load = generate(args.target, prompts, args.max_tokens, args.dtype, None, args.enforce_eager)
    spec, metrics, spec_load = generate(args.target, prompts, args.max_tokens, args.dtype, spec_config,
                                        args.enforce_eager)
    result = {
        "prompts": prompts, "plain": plain, "spec": spec, "identical": plain == spec,
        "speculative_config": spec_config, "metrics": metrics,
        "seconds": {"plain_load": plain_load, "spec_load": spec_load, "total": time.perf_counter() - started},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("identical", "metrics", "seconds")}))


if __name__ == "__main__":  # vLLM starts its engine in a spawned process that re-imports this file
    main()
