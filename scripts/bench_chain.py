"""τ of a chain against a tree on the shipped head: what DART keeps when the engine verifies only a chain (vLLM).

Four drafts, each verified by our own loop (greedy, the same target and head, held-out prompts):

- **argmax chain**: each of the head's d rows' argmax, no trie (what vLLM's parallel-drafting
  proposer drafts from a DART head): `shape=chain, draft_top_k=1, remain_total=d`;
- **trie chain K=d**: `tree=chain` (configs/tree/chain.yaml: the n-gram-enforced beam search,
  top-16 / beam 4 with the trie) and its best path of depth d (`dart_infer.tree.chain.best_chain`);
- **trie chain K=best**: the same at each K of `--ks` (and d); the best K is the one with the most
  tokens/s on this machine (`--best-by tau`: the highest τ), the whole sweep is printed too;
- **tree**: the default CPU tree for the dtype (tree=cpu in bf16, tree=cpu-fp32 in fp32).

Prompts: the first user turn of `--limit` conversations of each benchmark (MT-Bench, HumanEval,
ShareGPT held out), as `dart-eval` loads them; each prompt runs every draft and plain decoding
(`ar`, the speed baseline) interleaved, through `dart_infer.evaluation.evaluate.Evaluator`, and the
rows come from `dart_infer.evaluation.results.summarize`: τ = tokens per verification step (bonus
included), α_j = share of steps that accepted >= j draft tokens.

The trie is resolved like dart-eval's `ngram_model` (`--trie auto`: runs/ngram/sharegpt/full.ngt, built
by `dart-ngram`; without it the chains search without the n-gram term and the script says so).

    python scripts/bench_chain.py                                   # 10 prompts per benchmark, 128 tokens
    python scripts/bench_chain.py --limit 1 --max-new-tokens 8      # a smoke run
    python scripts/bench_chain.py --ks 2,4,6 --dtype float32 --json runs/bench_chain.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

BENCHMARKS = ("mtbench", "humaneval", "sharegpt-heldout")


def draft_settings(chain: Any, tree: Any, depth: int, ks: list[int], trie: bool) -> dict[str, Any]:
    """Label -> TreeSearchSettings of every draft measured (the K sweep included)."""
    kind = "trie chain" if trie else "search chain (no trie)"
    drafts = {"argmax chain": dataclasses.replace(chain, draft_top_k=1, beam_width=1, remain_total=depth)}
    for k in sorted({*ks, depth}):
        drafts[f"{kind} K={k}"] = dataclasses.replace(chain, remain_total=k)
    drafts["tree"] = tree
    return drafts


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--head", default="dart-smollm2-135m-instruct")
    parser.add_argument("--trie", default="auto", help="auto (the default trie, if built) | none | a trie file")
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    parser.add_argument("--limit", type=int, default=10, help="prompts per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ks", default="2,3,4,5,6", help="chain lengths K of the sweep (d is always added)")
    parser.add_argument("--best-by", choices=("speed", "tau"), default="speed")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where it is faster here) | float32 | bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write every row here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from omegaconf import OmegaConf

    from dart_infer import DartModel, TreeSearchSettings
    from dart_infer.cli.eval import benchmark_conversations
    from dart_infer.common.configs import configs_dir
    from dart_infer.common.dtypes import as_dtype, resolve_dtype_name
    from dart_infer.data.resolve import default_trie_path, model_vocabulary, resolve_trie
    from dart_infer.evaluation.evaluate import EvalSettings, Evaluator, _Run
    from dart_infer.evaluation.results import summarize

    dtype = as_dtype(resolve_dtype_name(args.dtype))
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    benchmarks = {name: benchmark_conversations(name, args.limit) for name in args.benchmarks.split(",")}
    choice = resolve_trie(args.trie, vocabulary=lambda: model_vocabulary(args.model), default=default_trie_path(),
                          key="--trie")
    if choice.notice:
        print(choice.notice)  # e.g. the default trie is not built yet: `dart-ngram` builds it
    chain = TreeSearchSettings().with_overrides(OmegaConf.to_container(OmegaConf.load(configs_dir() / "tree" / "chain.yaml")))
    model = DartModel.from_pretrained(args.model, args.head, choice.path, dtype=dtype, tree=chain).eval()
    depth = int(model.draft_model.config.draft_length)
    tree = model.method.default_tree(model.target.device, dtype)
    drafts = draft_settings(chain, tree, depth, ks, model.trie is not None)

    # One evaluator: plain decoding (`ar`) plus one run per draft, each a DartModel on the same target
    # and head with its own tree settings, interleaved per prompt.
    evaluator = Evaluator(model, EvalSettings(methods=("ar",), max_new_tokens=args.max_new_tokens, threads=args.threads))
    for label, settings in drafts.items():
        variant = DartModel(model.base_model, model.draft_model, model.tokenizer, model.trie, tree=settings).eval()
        evaluator.runs.append(_Run(label, "dart", variant))
    evaluator.warm_up()
    records = []
    for name, conversations in benchmarks.items():
        records += evaluator.run(name, conversations, progress=args.progress)
    pooled = [dataclasses.replace(r, benchmark="all") for r in records]
    summary = {**summarize(records, depth), **summarize(pooled, depth)}
    rows = {bench: summary[bench]["T=0"] for bench in (*benchmarks, "all")}

    sweep = [label for label in drafts if " K=" in label]
    key = "tokens_per_second" if args.best_by == "speed" else "tau"
    best = max(sweep, key=lambda label: rows["all"][label][key] or 0.0)
    kind = sweep[0].split(" K=")[0]
    four = {"argmax chain": "argmax chain", f"{kind} K=d": f"{kind} K={depth}",
            f"{kind} K=best ({best.split(' K=')[1]})": best, "tree": "tree"}

    def nodes(label: str) -> str:  # verified nodes per step, root excluded (a tree: + its copy span)
        settings = drafts[label]
        if settings.shape == "chain":
            return str(min(settings.remain_total, depth))
        return f"{settings.remain_total}" + (f" + {settings.copy_span_tokens}" if settings.copy_span_tokens else "")

    print(f"\n{args.model} + {args.head}, {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} thread(s), "
          f"greedy, {args.max_new_tokens} tokens, first turns of {args.limit} prompt(s) per benchmark; "
          f"trie: {choice.path or 'none'}; d = {depth}; tree: top-{tree.draft_top_k} / beam {tree.beam_width} / "
          f"{tree.remain_total} nodes; chains: top-{chain.draft_top_k} / beam {chain.beam_width}\n")
    header = ["draft", "nodes", *(f"τ {b}" for b in benchmarks), "τ all", "× ar tok/s", "same as ar"]
    body = [[name, nodes(label), *(number(rows[b][label]["tau"]) for b in benchmarks), number(rows["all"][label]["tau"]),
             number(rows["all"][label].get("speedup_vs_ar")), number(rows["all"][label]["identical_to_ar"])]
            for name, label in four.items()]
    print(table(header, body))
    print("\nacceptance per position (all benchmarks; α_j = share of steps accepting >= j draft tokens)\n")
    body = [[name, *(number(a) for a in rows["all"][label]["acceptance_by_position"] or [])]
            for name, label in four.items()]
    print(table(["draft", *(f"α_{j}" for j in range(1, depth + 1))], body))
    print(f"\nK sweep ({kind}; best by {'tokens/s' if args.best_by == 'speed' else 'τ'}: {best})\n")
    body = [[label.split(" K=")[1], *(number(rows[b][label]["tau"]) for b in benchmarks),
             number(rows["all"][label]["tau"]), number(rows["all"][label].get("speedup_vs_ar"))] for label in sweep]
    print(table(["K", *(f"τ {b}" for b in benchmarks), "τ all", "× ar tok/s"], body))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {"model": args.model, "head": args.head, "trie": choice.path, "dtype": str(dtype), "depth": depth,
               "best": best, "drafts": {label: dataclasses.asdict(s) for label, s in drafts.items()},
               "rows": {bench: {label: rows[bench][label] for label in drafts} for bench in rows}}
        args.json.write_text(json.dumps(out, indent=1, default=str))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
