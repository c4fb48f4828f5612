#!/usr/bin/env bash
# Red-team RL (configs/redteam.yaml, docs/workflows/redteam.md) on NPROC processes of this machine:
#   scripts/train_redteam.sh NPROC [key=value overrides...]
# Writes models/redteam (relative to the current directory; pass output_dir=... to change it), with every
# attack, answer and score in models/redteam/attacks.jsonl. CONFIG picks another recipe. A thin wrapper
# over `alignkit launch`: MASTER_PORT (default 29500, or a free port if taken), NNODES, NODE_RANK,
# MASTER_ADDR and LAUNCHER (torchrun | deepspeed | accelerate) pass through; PYTHON picks the interpreter.
# Two nodes: NNODES=2 NODE_RANK=R MASTER_ADDR=IP MASTER_PORT=P scripts/train_redteam.sh 8
set -euo pipefail
NPROC="${1:?usage: $0 NPROC [key=value ...]}"
shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$(cd "$HERE/../configs" && pwd)/redteam.yaml}"
source "$HERE/_launch_args.sh"
exec "$PYTHON" -m alignkit launch --nproc-per-node "$NPROC" ${LAUNCH_ARGS[@]+"${LAUNCH_ARGS[@]}"} \
  "$CONFIG" "output_dir=models/redteam" "$@"
