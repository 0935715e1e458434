"""vLLM greedy decoding with and without an exported draft head, on the same prompts (run it in .venv-vllm).

    scripts/vllm_env.sh python scripts/vllm_greedy_check.py --target <target dir> \
        --speculative-config <export>/vllm_speculative_config.json --out check.json

Writes JSON: the token ids vLLM emits for every prompt plainly (`plain`) and with speculative
decoding (`spec`), whether they are equal (`identical`), vLLM's speculative-decoding counters
(`metrics`: drafts, draft tokens, accepted tokens, accepted per position) and timings. Greedy
speculative decoding is lossless, so in float32 `identical` must be true (tests/test_export.py and
tests/test_vllm_plugin.py run this on a tiny random target). Imports only vllm (no dart_* module:
vLLM's venv has other pins; a DART export needs the plugin `make vllm` installs there).

`--record-drafts` (parallel drafting, e.g. a DART export) also records every draft vLLM proposed:
`drafts[i]` lists, for prompt i, {"position": t, "bonus": x_{t+1}, "tokens": [k draft ids]}: the
draft forward's bonus slot sits at position t (it pairs the target's state at t with the new token
x_{t+1}), so the drafts continue the sequence x_0 .. x_{t+1}. The prompts then run one at a time
(batch 1) and the worker is reached with a callable (VLLM_ALLOW_INSECURE_SERIALIZATION=1, set here).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]


def _install_recorder(worker: Any) -> None:
    """On the worker: wrap the drafter's `propose` to keep (bonus position, bonus, drafts) per call."""
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    drafter = runner.drafter
    original = drafter.propose
    drafter.dart_records = []

    def propose(*args: Any, **kwargs: Any) -> Any:
        drafts = original(*args, **kwargs)
        # The first mask slot of the single request; the bonus slot is the one before it.
        masks = (drafter.input_ids == drafter.parallel_drafting_token_id).nonzero()
        if masks.numel() and drafts.shape[0] == 1:
            j = int(masks[0, 0]) - 1
            drafter.dart_records.append({"position": int(drafter.positions[j]), "bonus": int(drafter.input_ids[j]),
                                         "tokens": drafts[0].tolist()})
        return drafts

    drafter.propose = propose


def _take_records(worker: Any) -> list[dict[str, Any]]:
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    records, runner.drafter.dart_records = runner.drafter.dart_records, []
    return records


def generate(target: str, prompts: list[str | list[int]], max_tokens: int, dtype: str,
             speculative_config: dict[str, Any] | None, enforce_eager: bool,
             record: bool = False) -> tuple[list[list[int]], dict, float, list]:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=target, dtype=dtype, speculative_config=speculative_config, seed=0,
              enforce_eager=enforce_eager, disable_log_stats=False, max_model_len=512)
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Token-id prompts skip tokenization: both sides of a comparison see exactly the same ids.
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    drafts: list[list[dict[str, Any]]] = []
    if record:
        llm.collective_rpc(_install_recorder)
        outputs = []
        for one in inputs:  # batch 1: each draft call belongs to this prompt
            outputs += llm.generate([one], params, use_tqdm=False)
            drafts.append(llm.collective_rpc(_take_records)[0])
    else:
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
    return tokens, metrics, load_s, drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--speculative-config", required=True, help="an export's vllm_speculative_config.json")
    parser.add_argument("--prompts", default=None, help="JSON file: a list of prompts (strings, or lists of token ids)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="float32: the exactness mode (bf16 rounds differently)")
    parser.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile (faster start)")
    parser.add_argument("--record-drafts", action="store_true",
                        help="record every draft of the speculative run (parallel drafting; prompts run one by one)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else DEFAULT_PROMPTS
    spec_config = json.loads(Path(args.speculative_config).read_text())
    if args.record_drafts:  # the recorder is a callable sent to the worker process
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    started = time.perf_counter()
    plain, _, plain_load, _ = generate(args.target, prompts, args.max_tokens, args.dtype, None, args.enforce_eager)
    spec, metrics, spec_load, drafts = generate(args.target, prompts, args.max_tokens, args.dtype, spec_config,
                                                args.enforce_eager, record=args.record_drafts)
    result = {
        "prompts": prompts, "plain": plain, "spec": spec, "identical": plain == spec,
        "speculative_config": spec_config, "metrics": metrics, "drafts": drafts,
        "seconds": {"plain_load": plain_load, "spec_load": spec_load, "total": time.perf_counter() - started},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("identical", "metrics", "seconds")}))


if __name__ == "__main__":  # vLLM starts its engine in a spawned process that re-imports this file
    main()
