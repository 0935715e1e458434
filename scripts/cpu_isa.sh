#!/usr/bin/env bash
# Run a command as on an AVX2-only x86 CPU (no AVX-512, AVX512-BF16, AMX), on a CPU that has more:
#   scripts/cpu_isa.sh avx2 dart-eval compile=true 'methods=[ar,dart,vllm]' model.dtype=float32 ...
# The kernels' instruction sets are capped (ATen and inductor's generated code: ATEN_CPU_CAPABILITY;
# oneDNN, torch's and vLLM's: ONEDNN_MAX_CPU_ISA; MKL: MKL_ENABLE_INSTRUCTIONS), and torch's CPU
# feature checks answer False for AVX-512/AMX (cpu_isa/sitecustomize.py), so vLLM loads its AVX2
# kernel library and bf16 has no oneDNN kernels, as on the real machine. Memory, caches and clock
# stay this machine's: numbers taken so are labelled "AVX2 emulated on <this CPU>", not an AVX2 CPU's.
set -euo pipefail
if [[ $# -lt 2 || $1 != avx2 ]]; then
  echo "usage: scripts/cpu_isa.sh avx2 COMMAND [ARGS...]   (only avx2 is emulated)" >&2
  exit 2
fi
shift
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 DART_EMULATED_ISA=avx2
export PYTHONPATH=$(cd "$(dirname "$0")/cpu_isa" && pwd)${PYTHONPATH:+:$PYTHONPATH}
exec "$@"
