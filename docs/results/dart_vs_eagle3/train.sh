# DART vs EAGLE-3 at an equal budget: same data, recipe, steps and tokens; trained one after the other, 2 threads each.
#   STEPS=100 bash docs/results/dart_vs_eagle3/train.sh        # the 0.2 M-token run in the README (online states)
#   STEPS=1500 LIMIT=9000 MAXLEN=512 STATES=offline OUT=runs/cmp3m bash docs/results/dart_vs_eagle3/train.sh
#       # the >= 3 M-token run (9,000 train conversations cut at 512 tokens = 3.0 M tokens, one pass; 512
#       # because serving starts from first turns: docs/results/recipe_ab_2026-12-02.md): the target's
#       # states are computed once into runs/state-cache (~12 GB) and both heads read them
# Rerunning the same command continues where it stopped (resume=auto); a finished head is not retrained.
# LR sets both heads' peak lr; DART_LR / EAGLE3_LR set one head's (lr_sweep.sh picks them).
# Then: OUT=<same> bash docs/results/dart_vs_eagle3/eval.sh (trees fitted per method, then served).
OUT=${OUT:-runs/cmp}
mkdir -p "$OUT"
COMMON="data=sharegpt data.limit=${LIMIT:-null} states=${STATES:-online} preprocess.max_length=${MAXLEN:-1024} \
 trainer.max_tokens=2048 trainer.grad_accum=1 trainer.max_steps=${STEPS:-400} trainer.max_anchors=192 \
 trainer.save_every=${SAVE_EVERY:-100} optim.warmup_steps=20 draft.init_output_from_target=true \
 train_eval.every=${EVAL_EVERY:-200} train_eval.limit=12 logging.wandb.enabled=false logging.progress=false \
 logging.log_every=10 resume=auto"
train() {  # name, extra overrides...
  local name=$1; shift
  [ -f "$OUT/$name/summary.json" ] && { echo "$OUT/$name: finished, not retrained"; return; }
  .venv/bin/dart-train output_dir="$OUT/$name" $COMMON "$@" >> "$OUT/$name.log" 2>&1
}
{  # one compound command: bash reads it whole before it starts, so editing this file mid-run is safe
  train dart optim.lr=${DART_LR:-${LR:-1e-3}} train_eval.ngram_model=runs/ngram/sharegpt/full.ngt
  train eagle3 optim.lr=${EAGLE3_LR:-${LR:-1e-3}} draft=eagle3
  exit
}
