"""One streamed chat request to a running vLLM OpenAI-compatible server, with the `openai` client (run it in .venv-vllm).

    scripts/vllm_env.sh vllm serve <target> --speculative-config "$(cat <export>/vllm_speculative_config.json)" &
    scripts/vllm_env.sh python scripts/vllm_chat_check.py --base-url http://127.0.0.1:8000/v1 \
        --message "Write a short poem about the sea." --out chat.json

Greedy (temperature 0) and a fixed length (`ignore_eos`, vLLM's extra parameter) so two servers, or a
server and any other greedy decoder, can be compared token for token: writes JSON with the streamed
`text`, the `token_ids` and `prompt_token_ids` the server reports (`return_token_ids`), the number
of streamed chunks and the seconds to the first chunk and in all (tests/test_vllm_plugin.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--message", required=True, help="the user message")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key="EMPTY", timeout=600)
    model = args.model or client.models.list().data[0].id
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.message}], stream=True,
        temperature=0.0, max_tokens=args.max_tokens,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    text, token_ids, prompt_ids, chunks, first = [], [], None, 0, None
    for chunk in stream:
        data = chunk.to_dict()
        chunks += 1
        first = first if first is not None else time.perf_counter() - start
        prompt_ids = data.get("prompt_token_ids") or prompt_ids
        for choice in data.get("choices", []):
            text.append((choice.get("delta") or {}).get("content") or "")
            token_ids += choice.get("token_ids") or []
    result = {"model": model, "text": "".join(text), "token_ids": token_ids, "prompt_token_ids": prompt_ids,
              "chunks": chunks, "seconds": {"first_chunk": first, "total": time.perf_counter() - start}}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("text", "chunks", "seconds")}))


if __name__ == "__main__":
    main()
