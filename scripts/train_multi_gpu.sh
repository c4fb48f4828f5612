#!/usr/bin/env bash
# Train any config on several processes (GPUs) of this machine, or of several machines:
#   scripts/train_multi_gpu.sh CONFIG [NPROC] [key=value overrides...]
# NPROC defaults to the number of GPUs (1 without GPUs). A thin wrapper over `alignkit launch`:
# MASTER_PORT (default 29500, or a free port if taken), NNODES, NODE_RANK, MASTER_ADDR and
# LAUNCHER (torchrun | deepspeed | accelerate) pass through; PYTHON picks the interpreter.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=192.168.1.100 scripts/train_multi_gpu.sh configs/sft.yaml 4   # node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=192.168.1.100 scripts/train_multi_gpu.sh configs/sft.yaml 4   # node 1
set -euo pipefail
CONFIG="${1:?usage: $0 CONFIG [NPROC] [key=value ...]}"
shift
NPROC_ARGS=()
if [[ $# -gt 0 && "$1" != *=* ]]; then
  if [[ "$1" =~ ^[0-9]+$ ]]; then
    NPROC_ARGS=(--nproc-per-node "$1")
    shift
  else
    echo "$0: second argument '$1' is neither NPROC (a number) nor a key=value override; a training stage is chosen in the config (algorithm: ...)" >&2
    exit 2
  fi
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/_launch_args.sh"
exec "$PYTHON" -m alignkit launch ${NPROC_ARGS[@]+"${NPROC_ARGS[@]}"} ${LAUNCH_ARGS[@]+"${LAUNCH_ARGS[@]}"} "$CONFIG" "$@"
