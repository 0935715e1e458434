"""Does the simulated τ logged during training predict the τ that serving measures?

On the same held-out prompts (first user turn) this prints, for one head:

1. `dart_generate` τ: real greedy DART decoding (tokens per verification step, bonus included);
2. simulated τ on the target's own answers from step 1 (`reference=data`, every anchor): the
   estimator `dart-train` uses, fed the data it is exact for (target-greedy text). It averages over
   every decoding state, while decoding visits states in steps of its acceptance lengths, so the two
   agree up to that weighting;
3. simulated τ on the dataset's own answers (what `dart-train` logs when the held-out data was not
   regenerated): `tau_data` (coverage of that text) and `tau_target` (a lower bound of serving τ);
plus the head's held-out α_1..α_d (top-1 agreement with the target, teacher-forced).

    python scripts/check_simulated_tau.py --head runs/ref2/best --trie runs/ngram/sharegpt/full.ngt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dart_infer.common.configs import configs_dir
from dart_infer.data.conversations import chat_prompt, first_turn, load_conversations
from dart_infer.decoding.dart_model import DartModel
from dart_train.data.dataset import build_dataset
from dart_train.states.online import OnlineStateSource
from dart_train.trainer.simulated_tau import SimulatedTau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True, help="a DART head directory")
    parser.add_argument("--trie", default=None, help="n-gram trie file (omit: no trie)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--chat-template", default=None,
                        help="for a base model without one: gemma-turns | plain | a .jinja file (as model.chat_template)")
    parser.add_argument("--source", default="sharegpt")
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--limit", type=int, default=12, help="conversations")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=1024, help="dataset answers: tokens per sequence")
    parser.add_argument("--anchors", type=int, default=16, help="anchors per sequence for the dataset answers")
    parser.add_argument("--tree", default="cpu",
                        help="configs/tree/<name>.yaml, or a fit_tree.yaml (or the dart-eval run dir holding it)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    named = configs_dir() / "tree" / f"{args.tree}.yaml"
    if named.is_file():
        tree = OmegaConf.to_container(OmegaConf.load(named), resolve=True)
    else:  # a fit_tree.yaml that dart-eval action=fit_tree wrote, or its run directory
        from dart_infer.cli.tree_files import read_tree_file, tree_file

        path = tree_file(args.tree)
        if path is None:
            parser.error(f"--tree {args.tree!r}: no configs/tree/{args.tree}.yaml and not a file path")
        tree = read_tree_file(path)
    model = DartModel.from_pretrained(args.model, args.head, args.trie, tree=tree, dtype=torch.float32,
                                  chat_template=args.chat_template)
    tokenizer, draft = model.tokenizer, model.draft_model
    conversations = [c for c in load_conversations(args.source, split=args.split, limit=args.limit)
                     if any(m["role"] == "user" for m in c.messages)]

    # 1. serving: greedy DART on the first user turn; keep its answers as target-greedy data.
    emitted: list[int] = []
    answers = []
    for index, conversation in enumerate(conversations):
        prompt = chat_prompt(tokenizer, first_turn(conversation))
        output, stats = model.dart_generate(prompt, max_new_token_num=args.max_new_tokens, return_stats=True)
        emitted += stats.emitted
        answer = output.reshape(-1)[prompt.numel():].cpu()
        answers.append({
            "input_ids": torch.cat([prompt, answer]),
            "loss_mask": torch.cat([torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(answer.numel(), dtype=torch.bool)]),
            "index": index,
        })
        print(f"[{index + 1}/{len(conversations)}] {answer.numel()} tokens, τ {stats.tau:.2f}", flush=True)
    tau_generate = sum(emitted) / len(emitted)

    def simulated(dataset, anchors: int) -> dict[str, float]:
        states = OnlineStateSource(model.target, topk=64, hidden_dtype=torch.float32)
        return SimulatedTau(
            dataset, states, eos_token_ids=model.eos_token_ids, trie=model.trie, tree=model.tree,
            anchors_per_sequence=anchors,
        )(draft)

    # 2. the estimator on exactly the text the target generated (every anchor).
    on_answers = simulated(answers, anchors=args.max_new_tokens)
    # 3. the estimator on the dataset's own answers (what training logs on non-regenerated data).
    on_dataset = simulated(build_dataset(conversations, tokenizer, args.max_length), anchors=args.anchors)

    d = draft.config.draft_length
    alphas = " ".join(f"{on_dataset[f'alpha_{j + 1}']:.3f}" for j in range(d))
    print(f"\nhead {args.head}, trie {args.trie}, tree={args.tree}, {len(conversations)} {args.source}/{args.split} prompts")
    print("| measure | τ |\n|---|---|")
    print(f"| dart_generate, greedy ({len(emitted)} steps) | {tau_generate:.3f} |")
    print(f"| simulated, target's own answers ({int(on_answers['anchors'])} anchors) | {on_answers['tau_data']:.3f} |")
    print(f"| simulated, dataset answers: tau_data ({int(on_dataset['anchors'])} anchors) | {on_dataset['tau_data']:.3f} |")
    print(f"| simulated, dataset answers: tau_target | {on_dataset['tau_target']:.3f} |")
    print(f"held-out α_1..α_{d} (dataset answers): {alphas}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "tau_generate": tau_generate,
            "simulated_on_answers": on_answers, "simulated_on_dataset": on_dataset,
        }, indent=2))


if __name__ == "__main__":
    main()
