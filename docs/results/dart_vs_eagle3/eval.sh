# DART vs EAGLE-3, served: each head's tree fitted on this machine in bf16, then both evaluated against
# the baselines, methods interleaved per prompt. Run after the training sweep, OUT = its hydra.sweep.dir
# (dart-train -m experiment=dart_vs_eagle3 cmp_head=dart,eagle3: runs/cmp3m/{dart,eagle3}):
#   OUT=runs/cmp3m bash docs/results/dart_vs_eagle3/eval.sh
# LIMIT prompts x NEW tokens per benchmark (default 8 x 128); DART_GRID, EAGLE3_GRID: the fits' grids;
# BASELINES: the dtypes plain decoding is timed in (the fastest of them is the reference).
# The trees are fitted on ShareGPT train conversations that the experiment's data.limit=9000 did not train on (the
# first ones after row 9000 from other source conversations, opening with a user turn), so no benchmark
# prompt picks its own tree.
# DART runs the paper's search (draft + trie) in both steps: context n-grams and copy spans (our CPU
# extras, which EAGLE-3 has no counterpart of) are off; EXTRAS=1 adds a DART-as-served row.
set -euo pipefail
{  # one compound command: bash reads it whole before it starts, so editing this file mid-run is safe
OUT=${OUT:-runs/cmp}
LIMIT=${LIMIT:-8}
NEW=${NEW:-128}
BASELINES=${BASELINES:-[float32,bfloat16]}  # the dtypes plain decoding is also timed in
DART_GRID=${DART_GRID:-"fit.grid.draft_top_k=[8,16] fit.grid.beam_width=[4] fit.grid.remain_total=[12,24]"}
EAGLE3_GRID=${EAGLE3_GRID:-"fit.eagle3_grid.top_k=[4] fit.eagle3_grid.depth=[3,5,7] fit.eagle3_grid.total_tokens=[12,24]"}
FIT_PROMPTS_N=${FIT_PROMPTS_N:-3}
FIT_NEW=${FIT_NEW:-64}
DART=$OUT/dart/head
EAGLE3=$OUT/eagle3/head
PAPER_SEARCH="tree.context_ngram_weight=0 tree.context_ngram_propose=false tree.copy_span_tokens=0"
FIT_PROMPTS=$OUT/fit-prompts.jsonl
[ -f "$FIT_PROMPTS" ] || .venv/bin/python - "$FIT_PROMPTS" <<'EOF'
import json, sys
from dart_infer.data.conversations import load_conversations, source_conversation
train = load_conversations("sharegpt", split="train")
trained = {source_conversation(c.id) for c in train[:9000]}
rows = [c for c in train[9000:] if source_conversation(c.id) not in trained and c.messages[0]["role"] == "user"]
with open(sys.argv[1], "w") as f:
    for c in rows[:8]:
        f.write(json.dumps({"id": c.id, "messages": c.messages}) + "\n")
EOF
fit() {  # out dir, overrides...
  local dir=$1; shift
  [ -f "$dir/fit_tree.yaml" ] || .venv/bin/dart-eval action=fit_tree model.dtype=bfloat16 threads=2 \
    draft_model=$DART "benchmarks=[$FIT_PROMPTS]" fit.prompts=$FIT_PROMPTS_N fit.max_new_tokens=$FIT_NEW out_dir=$dir "$@" \
    > "$dir.log" 2>&1
}
fit $OUT/fit-dart $PAPER_SEARCH $DART_GRID
fit $OUT/fit-eagle3 fit.method=eagle3 eagle3_model=$EAGLE3 $EAGLE3_GRID
eagle3_flags=$(.venv/bin/python -c "import sys, yaml
tree = yaml.safe_load(open(sys.argv[1]))['tree']
print(' '.join(f'++eagle3_tree.{k}={v}' for k, v in tree.items()))" "$OUT/fit-eagle3/fit_tree.yaml")
.venv/bin/dart-eval model.dtype=bfloat16 threads=2 draft_model=$DART tree=$OUT/fit-dart/fit_tree.yaml \
  eagle3_model=$EAGLE3 $eagle3_flags 'benchmarks=[mtbench,humaneval,sharegpt-heldout]' limit=$LIMIT \
  max_new_tokens=$NEW 'temperature=[0.0]' 'methods=[ar,hf_generate,prompt_lookup,dart,eagle3]' "baseline_dtypes=$BASELINES" \
  out_dir=$OUT/served > "$OUT/served.log" 2>&1
if [ "${EXTRAS:-0}" = 1 ]; then  # DART as served by default on CPUs: the fitted size + context n-grams + copy spans
  .venv/bin/dart-eval model.dtype=bfloat16 threads=2 draft_model=$DART tree=$OUT/fit-dart/fit_tree.yaml \
    tree.context_ngram_weight=0.3 tree.context_ngram_propose=true tree.copy_span_tokens=10 \
    'benchmarks=[mtbench,humaneval,sharegpt-heldout]' limit=$LIMIT max_new_tokens=$NEW 'temperature=[0.0]' \
    'methods=[ar,dart]' 'baseline_dtypes=[bfloat16]' out_dir=$OUT/served-extras > "$OUT/served-extras.log" 2>&1
fi
exit
}
