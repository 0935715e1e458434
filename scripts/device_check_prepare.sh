#!/usr/bin/env bash
# Prepare the payload of the GPU device check (scripts/device_check.sh) on a machine with the
# project's venv and network access to PyPI, into .device/ (ignored through .git/info/exclude):
#   .device/whl/     wheels the device image lacks (Python 3.12): DeepSpeed, Hydra, OmegaConf, ANTLR,
#                    pydantic (+ core, cp312), hjson, gguf; the sdist-only ones are built into wheels here
#   .device/data/    train.jsonl.xz (ShareGPT train conversations) and mtbench.jsonl (prompts)
#   .device/model/   the SmolLM2 GGUF (98 MB, Q4_1) in parts small enough for one call each, + SHA256
#   .device/plan.txt the device calls to make, in order (each carries one model part; the last one
#                    also carries the wheels and data and runs the check)
# A call moves at most 64 MiB including the working tree, so the part size is what is left of
# --budget-mb after the tree (measured now) and the last call's wheels and data.
#
#   scripts/device_check_prepare.sh [--conversations 1500] [--prompts 40] [--budget-mb 60]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CONVERSATIONS=1500
PROMPTS=40
BUDGET_MB=60
while [[ $# -gt 0 ]]; do
  case $1 in
    --conversations) CONVERSATIONS=$2; shift 2 ;;
    --prompts) PROMPTS=$2; shift 2 ;;
    --budget-mb) BUDGET_MB=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

mkdir -p .git/info
grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
rm -rf .device && mkdir -p .device/whl .device/data .device/model

# 1. Wheels: versions pinned to what this venv runs (tested together).
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
binary=(hydra-core omegaconf pydantic pydantic-core annotated-types typing-inspection gguf)
for name in "${binary[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .device/whl "$name==$(version "$name")"
done
for name in deepspeed antlr4-python3-runtime hjson; do  # pure Python, published as sdists: build here
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .device/whl "$name==$(version "$name")"
done

# 2. Data: ShareGPT train conversations (the leak-free split) and MT-Bench prompts, as JSONL.
OMP_NUM_THREADS=1 "$PY" - "$CONVERSATIONS" "$PROMPTS" <<'EOF'
import json, lzma, sys
from dart_infer.data.conversations import load_conversations

def rows(conversations):
    return "".join(json.dumps({"id": str(c.id), "messages": c.messages}) + "\n" for c in conversations)

train = load_conversations("sharegpt", split="train", limit=int(sys.argv[1]))
with lzma.open(".device/data/train.jsonl.xz", "wt") as f:
    f.write(rows(train))
prompts = [c for c in load_conversations("mtbench", limit=int(sys.argv[2]))]
open(".device/data/mtbench.jsonl", "w").write(rows(prompts))
print(f"data: {len(train)} training conversations, {len(prompts)} MT-Bench prompts")
EOF

# 3. The model in parts.
GGUF=$("$PY" -c "from dart_infer.data.assets import EMBEDDED_MODELS as E, asset_path as a; e = E['smollm2-135m-instruct']; print(a(e.package, e.module, e.gguf_file))")
tree_bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | awk '/total$/ {s += $1} END {print s}')
last_bytes=$(du -cb .device/whl .device/data | awk '/total$/ {print $1}')
part_bytes=$(( BUDGET_MB * 1024 * 1024 - tree_bytes - last_bytes ))
if (( part_bytes < 8 * 1024 * 1024 )); then
  echo "the working tree ($((tree_bytes / 1048576)) MiB) leaves no room for model parts within ${BUDGET_MB} MiB" >&2
  exit 1
fi
split -b "$part_bytes" -d -a 2 "$GGUF" .device/model/part-
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") > .device/model/SHA256
parts=(.device/model/part-*)

# 4. The plan: one device call per part; the last one runs the check.
{
  echo "# device calls, in order, each within ~30 s of the previous (the machine stays warm that long;"
  echo "# ignored paths carried earlier stay on it). Working tree now: $((tree_bytes / 1048576)) MiB."
  for ((i = 0; i < ${#parts[@]} - 1; i++)); do
    echo "run(command='bash scripts/device_check.sh stash', carry=['${parts[i]}'], timeout_s=120)"
  done
  echo "run(command='bash scripts/device_check.sh run', carry=['${parts[-1]}', '.device/model/SHA256', '.device/whl', '.device/data'], timeout_s=600)"
} > .device/plan.txt
cat .device/plan.txt
du -sh .device/*
