#!/usr/bin/env bash
# Train any config on several processes (GPUs) of this machine, or of several machines:
#   scripts/train_multi_gpu.sh CONFIG [NPROC] [STAGE] [key=value overrides...]
# STAGE (pretrain | sft) picks the VLM stage of a vlm_sft config: scripts/train_multi_gpu.sh configs/vlm_pretrain.yaml pretrain
# NPROC defaults to the number of GPUs (1 without GPUs). A thin wrapper over `alignkit launch`:
# MASTER_PORT (default 29500, or a free port if taken), NNODES, NODE_RANK, MASTER_ADDR and
# LAUNCHER (torchrun | deepspeed | accelerate) pass through; PYTHON picks the interpreter.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=192.168.1.100 scripts/train_multi_gpu.sh configs/sft.yaml 4   # node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=192.168.1.100 scripts/train_multi_gpu.sh configs/sft.yaml 4   # node 1
set -euo pipefail
CONFIG="${1:?usage: $0 CONFIG [NPROC] [key=value ...]}"
shift
NPROC_ARGS=()
STAGE_ARGS=()
# up to two leading arguments before the overrides: NPROC (a number) and/or a VLM STAGE (pretrain | sft)
for _ in 1 2; do
  if [[ $# -gt 0 && "$1" != *=* ]]; then
    if [[ "$1" =~ ^[0-9]+$ && ${#NPROC_ARGS[@]} -eq 0 ]]; then
      NPROC_ARGS=(--nproc-per-node "$1")
      shift
    elif [[ ( "$1" == pretrain || "$1" == sft ) && ${#STAGE_ARGS[@]} -eq 0 ]]; then
      STAGE_ARGS=("vlm.stage=$1")   # the VLM stage (configs/vlm_*.yaml), as `alignkit train --stage` sets it
      shift
    else
      echo "$0: argument '$1' is neither NPROC (a number), a VLM stage (pretrain | sft) nor a key=value override; other training stages are chosen in the config (algorithm: ...)" >&2
      exit 2
    fi
  fi
done
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/_launch_args.sh"
exec "$PYTHON" -m alignkit launch ${NPROC_ARGS[@]+"${NPROC_ARGS[@]}"} ${LAUNCH_ARGS[@]+"${LAUNCH_ARGS[@]}"} "$CONFIG" ${STAGE_ARGS[@]+"${STAGE_ARGS[@]}"} "$@"
