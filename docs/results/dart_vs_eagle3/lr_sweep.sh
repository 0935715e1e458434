# The same learning-rate search for both heads: each lr in LRS trains DART and EAGLE-3 for STEPS steps
# (a full warm-up + cosine schedule at that length) on the first batches of the 3 M-token run's data,
# through the same offline state cache, then one table of each run's simulated held-out τ and α₁ at
# its last step. Run after (or before) the 3 M-token train.sh, so the cache is shared:
#   bash docs/results/dart_vs_eagle3/lr_sweep.sh          # LRS="5e-4 1e-3 2e-3" STEPS=200 OUT=runs/lr
set -euo pipefail
{  # one compound command: bash reads it whole before it starts, so editing this file mid-run is safe
OUT=${OUT:-runs/lr}
for lr in ${LRS:-5e-4 1e-3 2e-3}; do
  STEPS=${STEPS:-200} EVAL_EVERY=${STEPS:-200} SAVE_EVERY=${STEPS:-200} LIMIT=9000 MAXLEN=512 STATES=offline \
    LR=$lr OUT=$OUT/lr$lr bash docs/results/dart_vs_eagle3/train.sh
done
.venv/bin/python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
print("| lr | DART τ, α₁ | EAGLE-3 τ, α₁ |\n|---|---|---|")
for run in sorted(Path(sys.argv[1]).glob("lr*"), key=lambda p: float(p.name[2:])):
    cells = []
    for method in ("dart", "eagle3"):
        rows = [json.loads(x) for x in (run / method / "metrics.jsonl").read_text().splitlines() if x.strip()]
        last = [r for r in rows if "eval/tau" in r][-1]
        cells.append(f"{last['eval/tau']:.2f}, {last['eval/alpha_1']:.2f} (step {last['step']})")
    print(f"| {run.name[2:]} | {cells[0]} | {cells[1]} |")
EOF
exit
}
