# DART vs EAGLE-3 at an equal budget: same data, recipe, steps and tokens; trained one after the other, 2 threads each.
#   STEPS=100 bash docs/results/dart_vs_eagle3/train.sh        # the 0.2 M-token run in the README (online states)
#   STEPS=1500 LIMIT=4000 STATES=offline OUT=runs/cmp3m bash docs/results/dart_vs_eagle3/train.sh
#       # >= 3 M tokens each (4,000 train conversations ~ 3.2 M tokens, one pass): the target's states are
#       # computed once into runs/state-cache (~13 GB) and both heads read them
# Rerunning the same command continues where it stopped (resume=true); a finished head is not retrained.
OUT=${OUT:-runs/cmp}
mkdir -p "$OUT"
COMMON="data=sharegpt data.limit=${LIMIT:-null} states=${STATES:-online} preprocess.max_length=1024 \
 trainer.max_tokens=2048 trainer.grad_accum=1 trainer.max_steps=${STEPS:-400} trainer.max_anchors=192 \
 trainer.save_every=${SAVE_EVERY:-100} optim.lr=${LR:-1e-3} optim.warmup_steps=20 draft.init_output_from_target=true \
 train_eval.every=${EVAL_EVERY:-200} train_eval.limit=12 logging.wandb.enabled=false logging.progress=false \
 logging.log_every=10 resume=true"
train() {  # name, extra overrides...
  local name=$1; shift
  [ -f "$OUT/$name/summary.json" ] && { echo "$OUT/$name: finished, not retrained"; return; }
  .venv/bin/dart-train output_dir="$OUT/$name" $COMMON "$@" >> "$OUT/$name.log" 2>&1
}
train dart train_eval.ngram_model=runs/ngram/sharegpt/full.ngt
train eagle3 draft=eagle3
