#!/usr/bin/env bash
# The GPU device check (issue 15): on a lent GPU machine (python 3.12, torch, transformers; no
# DeepSpeed/Hydra, no network), train a DART head on SmolLM2 for a few minutes (ZeRO-2, bf16,
# compiled flex attention), evaluate it with the paper's tree and write device_check.json (tokens/s,
# peak memory, tau, speedup) to $OUT. Well under 10 minutes.
#
# Prepare once where the venv and PyPI are (scripts/device_check_prepare.sh): it writes .device/
# (wheels, data, the model GGUF in parts: one call moves at most 64 MiB) and .device/plan.txt, the
# calls to make in order:
#   scripts/device_check.sh stash     # calls 1..n-1: each carries one model part, which stays there
#   scripts/device_check.sh run       # the last call: installs, assembles, converts, runs the check
# Rehearsal / CI, on a CPU where the project is installed (same steps, tiny budgets):
#   scripts/device_check.sh run --dry-run --data chats.jsonl --prompts prompts.jsonl [--model DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/dart-device-check-out}
STASH=${DART_DEVICE_DIR:-/tmp/dart-device}
stage=${1:-}
shift || true

parts_here() { ls .device/model/part-* 2>/dev/null | wc -l; }

case $stage in
  stash)
    # The carried part stays under the ignored .device/ for the next call on this (warm) machine.
    echo "model parts on this machine: $(parts_here): $(ls .device/model 2>/dev/null | tr '\n' ' ')"
    ;;
  run)
    args=("$@")
    if [[ " ${args[*]-} " == *" --dry-run "* ]]; then
      exec "$PY" "$REPO/scripts/device_check.py" --out "$OUT" "${args[@]}"
    fi
    mkdir -p "$STASH" "$OUT"
    # 1. What the image lacks, from the carried wheels; then this project, built here (C++ extensions).
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STASH/site" \
      .device/whl/*.whl
    export PYTHONPATH=$STASH/site
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
      --target "$STASH/site" .
    # 2. The model: every part carried so far, checked against the digest of the whole file.
    gguf=$STASH/$(awk '{print $2}' .device/model/SHA256)
    cat .device/model/part-* > "$gguf"
    (cd "$STASH" && sha256sum -c "$REPO/.device/model/SHA256") || {
      echo "model parts missing or damaged ($(parts_here) here): make the stash calls of .device/plan.txt first" >&2
      exit 1
    }
    # Run outside the checkout, so the installed package (with its compiled extensions) is imported.
    cd "$STASH"
    "$PY" - "$gguf" "$STASH/smollm2" "$REPO/.device/data" "$STASH" <<'EOF'
import lzma, sys
from pathlib import Path
from dart_infer.data.assets import _convert_gguf  # the conversion `resolve_model` does for the embedded model

gguf, target, data, stash = (Path(a) for a in sys.argv[1:])
if not (target / "config.json").is_file():
    _convert_gguf(gguf, target)
(stash / "train.jsonl").write_bytes(lzma.decompress((data / "train.jsonl.xz").read_bytes()))
EOF
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    # Stage 4 (vLLM beside our DART) where the machine has a venv with CUDA vLLM + our plugin at
    # $STASH/vllm-venv; the lent machine has no network, so it is skipped (and says so) otherwise.
    vllm=()
    [[ -x $STASH/vllm-venv/bin/python ]] && vllm=(--vllm-venv "$STASH/vllm-venv")
    PYTHONUNBUFFERED=1 "$PY" "$REPO/scripts/device_check.py" --model "$STASH/smollm2" --data "$STASH/train.jsonl" \
      --prompts "$REPO/.device/data/mtbench.jsonl" --out "$OUT" --work "$STASH/work" "${vllm[@]}" "${args[@]}"
    ;;
  *)
    sed -n 2,14p "$0"
    exit 2
    ;;
esac
