"""Streamed chat requests to a running vLLM OpenAI-compatible server, with the `openai` client (run it in .venv-vllm).

    scripts/vllm_env.sh vllm serve <target> --speculative-config "$(cat <export>/vllm_speculative_config.json)" &
    scripts/vllm_env.sh python scripts/vllm_chat_check.py --base-url http://127.0.0.1:8000/v1 \
        --message "Write a short poem about the sea." --message "Name three rivers." --out chat.json

Every `--message` is one request, all sent at once (one thread each), so the server batches them;
`--max-tokens` gives one length for all or one per message. Greedy (temperature 0) and a fixed
length (`ignore_eos`, vLLM's extra parameter) so two servers, or a server and any other greedy
decoder, can be compared token for token: writes JSON `{"model", "requests": [...], "seconds"}`, per
request the streamed `text`, the `token_ids` and `prompt_token_ids` the server reports
(`return_token_ids`), the number of streamed chunks and the seconds to the first token and in all
(tests/test_vllm_plugin.py). `stream_chat` is also what scripts/bench_vllm_concurrency.py times.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def stream_chat(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat request of exactly `max_tokens` tokens: text, ids, chunks, timings."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, stream=True, temperature=0.0, max_tokens=max_tokens,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    text, token_ids, prompt_ids, chunks, first = [], [], None, 0, None
    for chunk in stream:
        data = chunk.to_dict()
        chunks += 1
        prompt_ids = data.get("prompt_token_ids") or prompt_ids
        for choice in data.get("choices", []):
            text.append((choice.get("delta") or {}).get("content") or "")
            new = choice.get("token_ids") or []
            if new and first is None:  # the first chunk may carry only the role
                first = time.perf_counter() - start
            token_ids += new
    return {"text": "".join(text), "token_ids": token_ids, "prompt_token_ids": prompt_ids, "chunks": chunks,
            "seconds": {"first_token": first, "total": time.perf_counter() - start}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--message", action="append", required=True, help="a user message (repeat: one request each)")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[32], help="one for all, or one per message")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    lengths = args.max_tokens * len(args.message) if len(args.max_tokens) == 1 else args.max_tokens
    if len(lengths) != len(args.message):
        parser.error(f"--max-tokens: {len(args.max_tokens)} values for {len(args.message)} messages")

    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key="EMPTY", timeout=600)
    model = args.model or client.models.list().data[0].id
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(args.message)) as pool:
        futures = [pool.submit(stream_chat, client, model, [{"role": "user", "content": m}], n)
                   for m, n in zip(args.message, lengths, strict=True)]
        requests = [f.result() for f in futures]
    result = {"model": model, "requests": requests, "seconds": time.perf_counter() - start}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps([{k: r[k] for k in ("text", "chunks", "seconds")} for r in requests]))


if __name__ == "__main__":
    main()
