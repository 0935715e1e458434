"""Long-context prompts for `dart-eval benchmarks=[<file>]` (run in .venv: the project's loaders):

    .venv/bin/python scripts/make_long_prompts.py --out runs/long_prompts.json --tokens 1250 --count 20

Each prompt is a code preamble of at least `--tokens` tokens (consecutive HumanEval prompts, no two
prompts sharing one, so no engine's prefix cache helps) and then one of three tasks on it (implement,
test, explain): what a user pasting a source file into a chat sends. Issue 40 measured decoding with
a ~1,250-token preamble this way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TASKS = ("Implement every function above. Answer with the code only.",
         "Write pytest unit tests for the functions above.",
         "Explain in plain words what each function above must do, one short paragraph each.")


def make_prompts(tokens: int, count: int, model: str) -> list[dict]:
    from dart_infer.data.assets import resolve_model
    from dart_infer.data.conversations import load_conversations
    from dart_infer.data.loaders import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(model), None)
    blocks = [c.messages[0]["content"].strip() for c in load_conversations("humaneval")]
    prompts, start = [], 0
    for i in range(count):
        kept: list[str] = []
        while len(tokenizer("\n\n".join(kept))["input_ids"]) < tokens:
            if start == len(blocks):
                raise SystemExit(f"HumanEval has too few prompts for {count} preambles of {tokens} tokens")
            kept.append(blocks[start])
            start += 1
        prompts.append({"id": f"long-{i}", "messages": [
            {"role": "user", "content": "\n\n".join(kept) + f"\n\n{TASKS[i % len(TASKS)]}"}]})
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=1250, help="tokens of each preamble, at least")
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer counts the tokens")
    args = parser.parse_args()
    prompts = make_prompts(args.tokens, args.count, args.model)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"wrote {len(prompts)} prompts of ≥ {args.tokens} preamble tokens to {args.out}")


if __name__ == "__main__":
    main()
