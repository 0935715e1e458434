"""The 16 chats `scripts/bench_vllm_concurrency.py` serves (run in .venv: the project's loaders):

    .venv/bin/python scripts/make_serving_prompts.py --out docs/results/vllm_concurrency_prompts.json

10 MT-Bench first turns (every 8th question: all 8 categories), 3 with a ~600-word code preamble
(HumanEval prompts) and 3 with a ~600-word text preamble (ShareGPT held-out replies): mixed lengths,
some long, as a served chat endpoint gets them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _cut_words(text: str, words: int) -> str:
    """The first `words` words of `text`, ended at a line or sentence end where one is near."""
    kept = " ".join(text.split(" ")[:words])
    end = max(kept.rfind("\n"), kept.rfind(". "))
    return kept[: end + 1] if end > len(kept) * 0.8 else kept


def make_prompts(words: int = 600) -> list[dict[str, Any]]:
    """16 chats of mixed length: 10 MT-Bench first turns (every 8th question: all 8 categories), 3 with a
    ~`words`-word code preamble (HumanEval prompts) and 3 with a ~`words`-word text preamble (ShareGPT
    held-out replies)."""
    from dart_infer.data.conversations import first_turn, load_conversations

    mtbench = load_conversations("mtbench")
    prompts = [{"id": f"mtbench-{c.id}", "messages": first_turn(c)} for c in mtbench[::8][:10]]
    humaneval = load_conversations("humaneval")
    code_tasks = ["Implement every function above. Answer with the code only.",
                  "Write pytest unit tests for the functions above.",
                  "Explain in plain words what each function above must do, one short paragraph each."]
    for i, task in enumerate(code_tasks):
        blocks, total = [], 0
        for conv in humaneval[i * 40:]:
            code = conv.messages[0]["content"].strip()
            blocks.append(code)
            total += len(code.split())
            if total >= words:
                break
        prompts.append({"id": f"code-{i}", "messages": [{"role": "user", "content": "\n\n".join(blocks)
                                                          + f"\n\n{task}"}]})
    text_tasks = ["Summarise the text above in five bullet points.",
                  "List every claim the text above makes, one per line.",
                  "Rewrite the text above for a ten-year-old."]
    # A conversation's assistant turns joined: few single held-out replies reach `words` words.
    replies = ["\n\n".join(m["content"] for m in c.messages if m["role"] == "assistant")
               for c in load_conversations("sharegpt", split="heldout")]
    replies = [r for r in replies if len(r.split()) >= words]
    for i, task in enumerate(text_tasks):
        prompts.append({"id": f"text-{i}", "messages": [{"role": "user", "content": _cut_words(replies[i * 5], words)
                                                          + f"\n\n{task}"}]})
    return prompts



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--words", type=int, default=600, help="words of each long preamble")
    args = parser.parse_args()
    prompts = make_prompts(args.words)
    Path(args.out).write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}: "
          + ", ".join(f"{p['id']} ({len(p['messages'][-1]['content'].split())} words)" for p in prompts))


if __name__ == "__main__":
    main()
