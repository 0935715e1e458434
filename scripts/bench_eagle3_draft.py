"""Draft cost per decoding step: DART's one parallel forward + tree search against EAGLE-3's
sequential dynamic tree, on SmolLM2-135M-Instruct's shapes with random heads (the cost does not
depend on the weights). Each step appends `--accepted` prefix positions to a draft cache of
`--context` positions, then builds one tree; the cache is rewound after every call.

    OMP_NUM_THREADS=1 python scripts/bench_eagle3_draft.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def median_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    from transformers import AutoConfig

    from dart_infer.data.assets import resolve_model
    from dart_infer.methods import get_method
    from dart_infer.methods.dart import DartDrafter
    from dart_infer.methods.dart.model import DartDraftConfig, DartDraftModel
    from dart_infer.methods.eagle3 import CPU_EAGLE3_TREE, Eagle3Drafter, Eagle3TreeSettings
    from dart_infer.target.step_cost import use_fast_matmul_layout
    from dart_infer.tree.settings import CPU_TREE, TreeSearchSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--accepted", type=int, default=2, help="prefix positions appended per step")
    parser.add_argument("--draft-vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(resolve_model("smollm2-135m-instruct"))
    embedding = torch.randn(config.vocab_size, config.hidden_size) * 0.02
    torch.manual_seed(0)
    dart = DartDraftModel(DartDraftConfig.from_target_config(config, draft_vocab_size=args.draft_vocab)).eval()
    method = get_method("eagle3")
    eagle = method.head_class(method.config_class.from_target_config(config, draft_vocab_size=args.draft_vocab)).eval()
    for head in (dart, eagle):
        use_fast_matmul_layout(head)
        head.set_target_embedding(embedding)
    width = 3 * config.hidden_size
    aux = torch.randn(1, args.context, width)
    ids = torch.randint(0, config.vocab_size, (1, args.context))
    new_aux, new_ids = torch.randn(1, args.accepted, width), torch.randint(0, config.vocab_size, (1, args.accepted))
    history = torch.randint(0, config.vocab_size, (args.context + 1,))

    class _Model:  # what DartDrafter reads from a DartModel
        draft_model, trie, eos_token_ids = dart, None, (2,)

    rows = []
    with torch.no_grad():
        for name, tree in (("DART", CPU_TREE), ("DART", TreeSearchSettings())):
            drafter = DartDrafter(_Model(), tree)
            drafter.update(aux, ids)
            length = drafter.cache.length

            def dart_step(drafter=drafter, length=length) -> None:
                drafter.cache.crop(length)
                drafter.update(new_aux, new_ids)
                drafter.propose(history)

            rows.append((name, f"top-{tree.draft_top_k}, beam {tree.beam_width}, {tree.remain_total} nodes",
                         median_ms(dart_step, args.repeats), 1))
        for tree in (CPU_EAGLE3_TREE, Eagle3TreeSettings()):
            drafter = Eagle3Drafter(eagle, tree)
            drafter.update(aux, ids)
            length = drafter.cache.length

            def eagle_step(drafter=drafter, length=length) -> None:
                drafter.cache.crop(length)
                drafter.update(new_aux, new_ids)
                drafter.propose(history)

            rows.append(("EAGLE-3", f"top-{tree.top_k}, depth {tree.depth}, {tree.total_tokens} nodes",
                         median_ms(eagle_step, args.repeats), tree.depth))
    print(f"| head | tree | draft ms per step (CPU, {args.threads} thread) | draft forwards per step |")
    print("|---|---|---|---|")
    for name, tree, ms, forwards in rows:
        print(f"| {name} | {tree} | {ms:.1f} | {forwards} |")


if __name__ == "__main__":
    main()
