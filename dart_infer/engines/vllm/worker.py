"""A vLLM engine that decodes token-id prompts sent to it one per line: `dart-eval`'s `vllm` method.

Runs inside vLLM's own venv (`make vllm`, started through `scripts/vllm_env.sh python <this file>`),
so it imports only vLLM and the standard library — never `dart_infer` (its pins differ). The parent
(`dart_infer.engines.vllm.runner`) talks JSON lines over stdin/stdout:

    → {"prompt_ids": [...], "max_new_tokens": 256, "temperature": 0.0, "top_p": 0.0, "top_k": 0, "seed": 0}
    ← {"tokens": [...], "seconds": 1.234, "drafts": 40, "accepted_per_position": [30, 18, 7]}

`seconds` is the wall time of `LLM.generate` for that one request (prefill + decoding), measured
here, so the pipe's cost is not counted — the same span `dart-eval` times for its own methods.
With a speculative config, `drafts` and `accepted_per_position` are that request's share of vLLM's own
spec-decode counters (verification steps, and how many accepted a draft at position 1, 2, ...).
The first line written is {"ready": true, "vllm": "<version>"} once the engine has loaded and warmed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="the target model's directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile (faster start, slower steps)")
    parser.add_argument("--speculative-config", default=None, help="JSON text, as vllm serve takes it")
    args = parser.parse_args()

    # The protocol owns stdout; vLLM and the engine processes it starts log to file descriptor 1, so
    # that descriptor becomes stderr before anything of vLLM loads.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {"speculative_config": json.loads(args.speculative_config)} if args.speculative_config else {}
    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              seed=0, disable_log_stats=not kwargs, **kwargs)  # get_metrics needs stats (spec decode only)

    def spec_counters() -> tuple[int, list[int]]:
        drafts, per_position = 0, []
        for metric in llm.get_metrics():
            if metric.name == "vllm:spec_decode_num_drafts":
                drafts = int(metric.value)
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                per_position = [int(v) for v in metric.values]
        return drafts, per_position

    def generate(ids: list[int], max_new: int, temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
                 seed: int = 0) -> tuple[list[int], float]:
        # Our "off" values (0) as vLLM's: top_p 1.0, top_k -1 (or 0, by version): no filtering.
        params = SamplingParams(temperature=temperature, top_p=top_p or 1.0, top_k=top_k if top_k > 0 else -1,
                                seed=seed if temperature > 0 else None, max_tokens=max_new)
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids), time.perf_counter() - start

    generate([1, 2, 3], 8)  # warm-up: the first request compiles and allocates
    print(json.dumps({"ready": True, "vllm": vllm.__version__}), file=protocol, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        drafts, per_position = spec_counters() if kwargs else (0, [])
        tokens, seconds = generate(
            list(request["prompt_ids"]), int(request["max_new_tokens"]), float(request.get("temperature", 0.0)),
            float(request.get("top_p", 0.0)), int(request.get("top_k", 0)), int(request.get("seed", 0)),
        )
        answer: dict = {"tokens": tokens, "seconds": seconds}
        if kwargs:
            drafts_after, per_position_after = spec_counters()
            answer["drafts"] = drafts_after - drafts
            answer["accepted_per_position"] = [
                after - (per_position[i] if i < len(per_position) else 0) for i, after in enumerate(per_position_after)
            ]
        print(json.dumps(answer), file=protocol, flush=True)


if __name__ == "__main__":
    main()
