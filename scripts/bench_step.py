"""The fixed cost of one decoding step, piece by piece, and where whole generations spend their time.

Part 1, micro-benchmarks (each piece alone, the context rewound after every call so every repeat
sees the same cache; median and best of `--repeats`): the target's AR step (`next_logits`), a tree
verification of `--nodes` nodes (`verify`), the cache bookkeeping after it (`keep_path`), the draft
head's step (`draft_step`, n accepted positions + its masks) and the draft-vocabulary lm_head.
Part 2, `profile=True` generations (AR and DART interleaved over `--prompts` MT-Bench first turns):
ms per step and per phase, tokens/s.

Only public APIs are used, so the same script measures an older checkout (run it from there) for
before/after numbers.

    OMP_NUM_THREADS=1 python scripts/bench_step.py --threads 1 --dtype float32
    python scripts/bench_step.py --head runs/ref2/best --trie runs/ngram/sharegpt/full.ngt --prompts 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """(median wall, best wall, median CPU) seconds of `fn` over `repeats` calls after two warm-ups.

    CPU time is the calling thread's (`time.thread_time`): with one torch thread it is what the work
    cost, whatever else the machine runs; wall times on a shared machine include waiting for a core.
    """
    fn()
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpus.append(time.thread_time() - start_cpu)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), min(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--chat-template", default=None,
                        help="for a base model without one: gemma-turns | plain | a .jinja file (as model.chat_template)")
    parser.add_argument("--head", default=None, help="a DART head directory (default: a random head)")
    parser.add_argument("--trie", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=300, help="cached tokens for the micro-benchmarks")
    parser.add_argument("--nodes", type=int, default=13, help="tree nodes (root included) to verify")
    parser.add_argument("--repeats", type=int, default=200, help="micro-benchmark calls (0: skip them)")
    parser.add_argument("--prompts", type=int, default=2, help="generations per method (0: micro-benchmarks only)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    from transformers import AutoConfig

    from dart_infer import DartDraftConfig, DartDraftModel, DartModel
    from dart_infer.assets import resolve_model
    from dart_infer.model import DraftKVCache

    tree = {"draft_top_k": 8, "beam_width": 6, "remain_total": args.nodes - 1}
    head = args.head
    if head is None:  # a random head with the demo's shape (16k draft vocabulary, 8 rows)
        import tempfile

        torch.manual_seed(0)
        config = DartDraftConfig.from_target_config(
            AutoConfig.from_pretrained(resolve_model(args.model)), draft_length=8, draft_vocab_size=16384
        )
        head = tempfile.mkdtemp(prefix="bench_step_head_")
        DartDraftModel(config).save_pretrained(head)
    model = DartModel.from_pretrained(args.model, head, args.trie, dtype=dtype, tree=tree,
                                  chat_template=args.chat_template)
    target, draft = model.target, model.draft_model
    generator = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=generator)
    aux, _, cache = target.prefill(prompt)
    past = cache.get_seq_length()
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} thread(s), {past} cached tokens, "
          f"{args.nodes}-node tree, {args.repeats} repeats; torch {torch.__version__}\n")

    n = args.nodes
    tokens = torch.randint(0, vocab, (n,), generator=generator)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))  # a chain costs what any n-node tree costs
    positions = torch.arange(n)
    accepted = [0, 2, 5] if n > 5 else list(range(min(3, n)))  # root + 2 nodes of a branching tree

    def ar_step() -> None:
        target.next_logits(torch.tensor([[1]]), cache)
        target.keep_path(cache, past, [])

    def verify() -> None:
        target.verify(tokens, positions, mask, cache)
        target.keep_path(cache, past, [])

    # The cache side of a DART step without the forward: n new entries per layer (what a verify
    # appends), then keep_path keeps the accepted ones.
    kv_heads = cache.layers[0].keys.shape[1]
    new_kv = torch.randn(1, kv_heads, n, cache.layers[0].keys.shape[-1], dtype=dtype)

    def grow() -> None:
        for layer in cache.layers:
            layer.update(new_kv, new_kv)

    def grow_and_keep() -> None:
        grow()
        target.keep_path(cache, past, accepted)
        target.keep_path(cache, past, [])

    draft_cache = DraftKVCache()
    draft.draft_step(aux, torch.randint(0, vocab, prompt.shape, generator=generator), draft_cache)
    draft_past = draft_cache.length
    step_aux = aux[:, :3]
    step_ids = prompt[:, :3]

    def draft_step() -> None:
        draft.draft_step(step_aux, step_ids, draft_cache)
        draft_cache.crop(draft_past)

    rows = torch.randn(1, draft.config.draft_length, draft.config.hidden_size, dtype=dtype)

    def draft_lm_head() -> None:
        draft.lm_head(rows)

    if args.repeats > 0:
        print("| piece | CPU ms (median) | wall ms (median) | wall ms (best) |\n|---|---|---|---|")
    for name, fn, reps in (
        ("target AR step (1 token)", ar_step, args.repeats),
        (f"target verify ({n} nodes)", verify, max(20, args.repeats // 4)),
        (f"cache append ({n} entries) + keep_path (3 kept)", grow_and_keep, args.repeats),
        ("draft_step (3 new positions)", draft_step, args.repeats),
        (f"draft lm_head ({draft.config.draft_length} rows)", draft_lm_head, args.repeats),
    ) if args.repeats > 0 else ():
        median, best, cpu = timed(fn, reps)
        print(f"| {name} | {cpu * 1e3:.2f} | {median * 1e3:.2f} | {best * 1e3:.2f} |", flush=True)

    if args.prompts <= 0:
        return
    from dart_infer.conversations import load_conversations
    from dart_infer.evaluate import chat_prompt, first_turn

    prompts = [chat_prompt(model.tokenizer, first_turn(c)) for c in load_conversations("mtbench", limit=args.prompts)]
    model.ar_generate(prompts[0], max_new_token_num=8)
    model.dart_generate(prompts[0], max_new_token_num=8)
    totals: dict[str, dict[str, float]] = {"ar": defaultdict(float), "dart": defaultdict(float)}
    for i, ids in enumerate(prompts):
        for kind in ("ar", "dart") if i % 2 == 0 else ("dart", "ar"):
            generate = model.ar_generate if kind == "ar" else model.dart_generate
            _, stats = generate(ids, max_new_token_num=args.max_new_tokens, profile=True, return_stats=True)
            row = totals[kind]
            row["steps"] += stats.steps
            row["tokens"] += stats.new_tokens
            row["wall"] += stats.wall_time
            row["emitted"] += sum(stats.emitted)
            for phase, seconds in stats.timings.items():
                row[phase] += seconds
    phases = ("prefill", "draft", "search", "verify", "bookkeeping")
    print("\n| method | tokens/s | τ | ms/step | " + " | ".join(f"{p} ms/step" for p in phases) + " |")
    print("|" + "---|" * (4 + len(phases)))
    for kind, row in totals.items():
        steps = max(1.0, row["steps"])
        per_phase = " | ".join(f"{row[p] / steps * 1e3:.2f}" for p in phases)
        print(f"| {kind} | {row['tokens'] / row['wall']:.1f} | {row['emitted'] / steps:.2f} | "
              f"{row['wall'] / steps * 1e3:.1f} | {per_phase} |")


if __name__ == "__main__":
    main()
