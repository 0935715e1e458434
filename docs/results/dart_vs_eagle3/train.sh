# DART vs EAGLE-3 at an equal budget: same data, recipe, steps and tokens; trained one after the other, 2 threads each.
mkdir -p runs/cmp
COMMON="data=sharegpt preprocess.max_length=1024 trainer.max_tokens=2048 trainer.grad_accum=1 trainer.max_steps=${STEPS:-400} \
 trainer.max_anchors=192 trainer.save_every=100 optim.lr=1e-3 optim.warmup_steps=20 draft.init_output_from_target=true \
 train_eval.every=200 train_eval.limit=12 logging.wandb.enabled=false logging.progress=false logging.log_every=10"
.venv/bin/dart-train output_dir=runs/cmp/dart $COMMON train_eval.ngram_model=runs/ngram/sharegpt/full.ngt > runs/cmp/dart.log 2>&1
.venv/bin/dart-train output_dir=runs/cmp/eagle3 $COMMON draft=eagle3 > runs/cmp/eagle3.log 2>&1
