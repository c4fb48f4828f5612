#!/usr/bin/env bash
# Train the Helpful-RM (reward model on helpful pairs) or the Harmless-RM (cost model on safety
# pairs) on NPROC processes of this machine:
#   scripts/train_rm_distributed.sh helpful|harmless NPROC [key=value overrides...]
# Writes models/<task>_rm (relative to the current directory). A thin wrapper over `alignkit launch`:
# MASTER_PORT (default 29500, or a free port if taken), NNODES, NODE_RANK, MASTER_ADDR and
# LAUNCHER (torchrun | deepspeed | accelerate) pass through; PYTHON picks the interpreter.
set -euo pipefail
TASK="${1:?usage: $0 helpful|harmless NPROC [key=value ...]}"
NPROC="${2:?usage: $0 helpful|harmless NPROC [key=value ...]}"
shift 2
case "$TASK" in helpful|harmless) ;; *) echo "task must be helpful or harmless, got '$TASK'" >&2; exit 2;; esac
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/_launch_args.sh"
exec "$PYTHON" -m alignkit launch --nproc-per-node "$NPROC" ${LAUNCH_ARGS[@]+"${LAUNCH_ARGS[@]}"} \
  "$(cd "$HERE/../configs" && pwd)/rm_${TASK}.yaml" "output_dir=models/${TASK}_rm" "$@"
