"""Ship a trained head with the package: bf16 safetensors + config.json + a model card, by name.

    python scripts/ship_head.py runs/ref3/best --run runs/ref3 --name dart-smollm2-135m-instruct \
        --eval runs/eval/ship-mtbench runs/eval/ship-humaneval --trained-at d256886 \
        --command "dart-train output_dir=runs/ref3 ..."

Writes `dart_infer/data/heads/<name>/` (model.safetensors in bfloat16, config.json naming the base model,
README.md: the model card with recipe, tokens seen, split, held-out τ curve and the dart-eval tables).
The weights are loaded and checked through the same loader users call (`load_draft_model`), and the
written directory is loaded back by its embedded name before the script returns. The repository keeps
every shipped version in its history, so replace the shipped file rarely.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

import torch
import yaml
from plot_tau_curve import curve  # scripts/ is on sys.path when this file runs as a script

from dart_infer.common.dtypes import cast_parameters
from dart_infer.data.assets import EMBEDDED_HEADS, HEADS_DIR, resolve_model
from dart_infer.methods.loading import load_draft_model

MAX_BYTES = 40 * 1024 * 1024


def model_card(name: str, head_dir: Path, run: Path | None, evals: list[Path], trained_at: str,
               command: str, base: str, prior_tokens: float = 0.0, continues: str = "",
               prior_table: Path | None = None) -> str:
    best = json.loads((head_dir / "best.json").read_text()) if (head_dir / "best.json").is_file() else {}
    step = int(best.get("step", 0))
    lines = [
        "---", "license: apache-2.0", f"base_model: {base}", "library_name: dart-spec",
        "tags: [speculative-decoding, dart, draft-head]", "---", "",
        f"# {name}", "",
        f"A DART draft head (one masked multi-position draft layer, arXiv 2601.19278) for `{base}` "
        "(SmolLM2-135M-Instruct), trained with this repository's `dart-train`. It ships inside the "
        "package and loads by name:", "",
        "```python",
        "from dart_infer import DartModel",
        f'model = DartModel.from_pretrained("{base}", "{name}", "runs/ngram/sharegpt/full.ngt")',
        "```", "",
        f"or `dart-eval draft_model={name}`, `dart-train draft.init_from={name}` (to continue training).",
        "Weights are bfloat16; loading in float32 serving casts them up (greedy fp32 output stays "
        "identical to the target's: verification is lossless whatever the head).", "",
        "## Training", "",
    ]
    if run is not None:
        points = curve(run)
        # Tokens per step from the curve's last point (training rows are logged every log_every steps).
        per_step = points[-1]["tokens"] / points[-1]["step"] if points else float("nan")
        tokens = per_step * step + prior_tokens
        cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else {}
        data = cfg.get("data", {})
        lines += [
            f"- Checkpoint: step {step} of the run (the best held-out τ so far: {best.get('tau', float('nan')):.3f}, "
            "simulated on held-out ShareGPT first turns answered by the target).",
            f"- Tokens seen: ≈ {tokens / 1e6:.1f} M training tokens (packed rows of "
            f"{cfg.get('trainer', {}).get('max_tokens', '?')} tokens, max_length "
            f"{cfg.get('preprocess', {}).get('max_length', '?')}).",
            f"- Data: `{data.get('name', data.get('_name_', 'sharegpt'))}` train split — ShareGPT split by source "
            "conversation (no conversation and no repeated first user turn on both sides; "
            "`dart_infer.data.conversations.sharegpt_heldout_ids`); the original answers, not regenerated.",
            f"- Optimiser: lr {cfg.get('optim', {}).get('lr', '?')}, warm-up "
            f"{cfg.get('optim', {}).get('warmup_steps', '?')} steps, cosine to "
            f"{cfg.get('trainer', {}).get('max_steps', '?')} steps; anchors per row "
            f"{cfg.get('trainer', {}).get('max_anchors', '?')}; draft vocabulary "
            f"{cfg.get('draft', {}).get('draft_vocab_size', '?')}.",
            f"- Code: trained from commit {trained_at}.",
        ]
        if continues:
            lines.append(f"- Continued training: {continues} (tokens above include the "
                         f"{prior_tokens / 1e6:.2f} M seen before).")
        if command:
            lines += ["", "```bash", command, "```"]
        if points:
            lines += ["", "Held-out τ (simulated, the run's train_eval) against training tokens:", "",
                      "| run | step | tokens (M) | τ | eval loss |", "|---|---|---|---|---|"]
            for row in (prior_table.read_text().splitlines()[2:] if prior_table else []):
                cells = [c.strip() for c in row.strip().strip("|").split("|")]
                # A plot_tau_curve.py table: run, step, tokens, τ, τ target, α_1, loss. The shipped run's
                # own rows come from its metrics below, so a table that also covers it is not repeated.
                if len(cells) == 7 and cells[0] != run.name:
                    lines.append(f"| {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {cells[6]} |")
            lines += [f"| {run.name} | {p['step']} | {(p['tokens'] + prior_tokens) / 1e6:.2f} | {p['tau']:.3f} | "
                      f"{p['loss']:.2f} |" for p in points]
    lines += ["", "## Served τ and speed (dart-eval on this repository's CPU reference machine)", ""]
    if not evals:
        lines.append("Not measured yet.")
    for directory in evals:
        results = json.loads((directory / "results.json").read_text())
        meta = results.get("meta", {})
        lines += [f"`{directory.name}`: {json.dumps({k: meta[k] for k in ('command',) if k in meta})}"
                  if "command" in meta else f"`{directory.name}`:", "",
                  (directory / "results.md").read_text().strip(), ""]
    lines += ["", f"Card written {date.today().isoformat()} by `scripts/ship_head.py`."]
    return "\n".join(lines) + "\n"


def ship(head_dir: Path, name: str, run: Path | None, evals: list[Path], trained_at: str, command: str,
         **card: Any) -> Path:
    if name not in EMBEDDED_HEADS:
        raise SystemExit(f"'{name}' is not in dart_infer.data.assets.EMBEDDED_HEADS {sorted(EMBEDDED_HEADS)}: add it there first")
    head = cast_parameters(load_draft_model(head_dir, dtype=torch.float32), torch.bfloat16)
    head.config.base_model = EMBEDDED_HEADS[name]
    out = HEADS_DIR / name
    with tempfile.TemporaryDirectory(dir=HEADS_DIR.parent) as staging:
        stage = Path(staging) / name
        head.save_pretrained(stage)
        size = (stage / "model.safetensors").stat().st_size
        if size > MAX_BYTES:
            raise SystemExit(f"model.safetensors is {size / 2**20:.1f} MiB, over the 40 MiB the repository allows")
        (stage / "README.md").write_text(
            model_card(name, head_dir, run, evals, trained_at, command, EMBEDDED_HEADS[name], **card))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        stage.rename(out)
    reloaded = load_draft_model(resolve_model(name))  # by its embedded name, as users load it
    assert all(p.dtype == torch.bfloat16 for p in reloaded.parameters())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head", type=Path, help="a head directory (config.json + model.safetensors)")
    parser.add_argument("--name", default="dart-smollm2-135m-instruct")
    parser.add_argument("--run", type=Path, help="the dart-train run dir (config.yaml, metrics.jsonl)")
    parser.add_argument("--eval", type=Path, nargs="*", default=[], help="dart-eval out_dirs for the card")
    parser.add_argument("--trained-at", default="unknown", help="commit the run was trained at")
    parser.add_argument("--command", default="", help="the dart-train command line for the card")
    parser.add_argument("--continues", default="", help="what the run continued from (draft.init_from), for the card")
    parser.add_argument("--prior-tokens", type=float, default=0.0, help="million tokens the head saw before the run")
    parser.add_argument("--prior-table", type=Path, help="plot_tau_curve.py table of the earlier run(s) (rows of --run itself are skipped)")
    args = parser.parse_args()
    out = ship(args.head, args.name, args.run, args.eval, args.trained_at, args.command,
               prior_tokens=args.prior_tokens * 1e6, continues=args.continues, prior_table=args.prior_table)
    print(f"shipped {args.head} as '{args.name}' in {out} "
          f"({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
