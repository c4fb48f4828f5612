#!/usr/bin/env bash
# Safe-MM-DPO (the seed guides' `bash scripts/train_dpo_distributed.sh 8`) on NPROC processes of this machine:
#   scripts/train_dpo_distributed.sh NPROC [key=value overrides...]
# Uses configs/safe_dpo.yaml (LoRA: CONFIG=configs/safe_dpo_lora.yaml; plain DPO: CONFIG=configs/dpo.yaml
# or configs/dpo_lora.yaml) and writes models/aligned (relative to the current directory; pass
# output_dir=... to change it). Safe-MM-DPO reads models/helpful_rm/final and models/harmless_rm/final,
# which scripts/train_rm_distributed.sh helpful|harmless NPROC writes. A thin wrapper over `alignkit launch`:
# MASTER_PORT (default 29500, or a free port if taken), NNODES, NODE_RANK, MASTER_ADDR and
# LAUNCHER (torchrun | deepspeed | accelerate) pass through; PYTHON picks the interpreter.
set -euo pipefail
NPROC="${1:?usage: $0 NPROC [key=value ...]}"
shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$(cd "$HERE/../configs" && pwd)/safe_dpo.yaml}"
source "$HERE/_launch_args.sh"
exec "$PYTHON" -m alignkit launch --nproc-per-node "$NPROC" ${LAUNCH_ARGS[@]+"${LAUNCH_ARGS[@]}"} \
  "$CONFIG" "output_dir=models/aligned" "$@"
