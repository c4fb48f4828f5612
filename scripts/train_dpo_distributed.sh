#!/usr/bin/env bash
# DPO on NPROC processes of this machine:
#   scripts/train_dpo_distributed.sh NPROC [key=value overrides...]
# Uses configs/dpo.yaml (configs/dpo_lora.yaml for LoRA: pass CONFIG=configs/dpo_lora.yaml) and
# writes models/dpo (relative to the current directory). A thin wrapper over `alignkit launch`:
# MASTER_PORT (default 29500, or a free port if taken), NNODES, NODE_RANK, MASTER_ADDR and
# LAUNCHER (torchrun | deepspeed | accelerate) pass through; PYTHON picks the interpreter.
set -euo pipefail
NPROC="${1:?usage: $0 NPROC [key=value ...]}"
shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$(cd "$HERE/../configs" && pwd)/dpo.yaml}"
source "$HERE/_launch_args.sh"
exec "$PYTHON" -m alignkit launch --nproc-per-node "$NPROC" ${LAUNCH_ARGS[@]+"${LAUNCH_ARGS[@]}"} \
  "$CONFIG" "output_dir=models/dpo" "$@"
