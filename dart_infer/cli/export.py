"""`dart-export`: write a trained head for a serving engine (vLLM or SGLang); `dart_infer.engines.export` does the work.

    dart-export runs/my-head/head --out exports/my-head                # DART: vLLM through our plugin
    dart-export runs/my-eagle3/head --out exports/my-eagle3            # EAGLE-3: vLLM (speculators format)
    dart-export runs/my-eagle3/head --out exports/my-eagle3-sgl --format sglang
    dart-export runs/my-head/head --out exports/my-head --draft-max-batch 8   # draft at <= 8 concurrent requests
    dart-export runs/my-head/head --out exports/my-head --ngram-model runs/ngram/sharegpt/full.ngt  # trie chain
    vllm serve <target> --speculative-config "$(cat exports/my-head/vllm_speculative_config.json)"

Bad input (unknown head, a DART head for SGLang, an existing non-empty --out, a bad option) is one
line on stderr and exit code 2, as for every dart-* command (`dart_infer.common.errors`).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from dart_infer.common.errors import InputError, report

COMMAND = "dart-export"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like every other bad input
        raise InputError(f"{message} (dart-export --help)")


def parser() -> argparse.ArgumentParser:
    from dart_infer.engines.export import (
        DART_CPU_DRAFT_MAX_BATCH,
        DEFAULT_SPECULATIVE_TOKENS,
        DRAFT_ALWAYS,
        DRAFT_AUTO,
        FORMATS,
    )

    p = _Parser(prog=COMMAND, description="Write a trained draft head for a serving engine.")
    p.add_argument("head", help="head directory (<run>/head, <run>/best) or embedded head name")
    p.add_argument("--out", required=True, help="new (or empty) directory to write")
    p.add_argument("--format", default="vllm", choices=FORMATS,
                   help="vllm: DART plugin layout / EAGLE-3 speculators format; sglang: SpecForge/SGLang "
                        "layout, EAGLE-3 only (default vllm)")
    p.add_argument("--target", default=None,
                   help="the target model the head was trained for (default: from the head or its dart-train run)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step written into the configs (default: a DART head's draft length "
                        f"d, all its rows from one forward; {DEFAULT_SPECULATIVE_TOKENS} for EAGLE-3)")
    p.add_argument("--draft-max-batch", default=DRAFT_AUTO, metavar="B",
                   help="draft while at most B requests run together, none above (vLLM's "
                        f"num_speculative_tokens_per_batch_size); '{DRAFT_ALWAYS}': at every batch size; "
                        f"'{DRAFT_AUTO}' (default): {DART_CPU_DRAFT_MAX_BATCH} for a DART head exported without a "
                        f"CUDA GPU (measured on CPUs, docs/vllm.md), '{DRAFT_ALWAYS}' otherwise")
    p.add_argument("--ngram-model", default=None, metavar="TRIE",
                   help="a DART head's trie (a dart-ngram file, or 'auto': the default one if built): the plugin then "
                        "drafts the trie-chosen chain (the n-gram-enforced beam search's best path) instead of "
                        "each row's argmax; the export records the trie's path, it does not copy it")
    return p


def main(argv: list[str] | None = None) -> None:
    try:
        args = parser().parse_args(argv)
        from transformers.utils import logging as hf_logging

        from dart_infer.engines.export import SPEC_CONFIG_FILE, export_head

        hf_logging.disable_progress_bar()  # stderr carries only what went wrong

        result = export_head(args.head, args.out, args.format, target=args.target,
                             num_speculative_tokens=args.num_speculative_tokens,
                             draft_max_batch=args.draft_max_batch, ngram_model=args.ngram_model)
    except (Exception, KeyboardInterrupt) as err:
        sys.exit(report(err, COMMAND))
    print(f"{COMMAND}: wrote the {result.kind} head ({result.format}) to {result.out_dir}")
    print(f"  target: {result.verifier}")
    if result.kind == "dart":
        print(f"  drafts: the trie-chosen chain (trie {result.chain['ngram_model']})" if result.chain
              else "  drafts: the argmax chain (--ngram-model adds the trie-chosen one)")
    schedule = result.speculative_config.get("num_speculative_tokens_per_batch_size")
    if schedule:
        most = schedule[0][1]
        print(f"  drafts while at most {most} request{'s run' if most > 1 else ' runs'} at a time, none above "
              "(--draft-max-batch)")
    # vLLM's --speculative-config takes the JSON text, not a file name.
    print(f"  vllm serve {result.verifier} --speculative-config \"$(cat {result.out_dir / SPEC_CONFIG_FILE})\"")


if __name__ == "__main__":
    main()
