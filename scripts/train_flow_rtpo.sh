#!/usr/bin/env bash
# Flow-RTPO (configs/flow_rtpo.yaml, docs/workflows/redteam.md "Flow-RTPO"): the red-team attacker and the
# flow-matching image policy trained together, on NPROC processes of this machine, through accelerate launch:
#   scripts/train_flow_rtpo.sh NPROC [key=value overrides...]
# Single node, 8 GPUs (the guide's `accelerate launch --num_processes 8 ...`):
#   scripts/train_flow_rtpo.sh 8
# Two nodes of 8 GPUs (the guide's `--num_machines 2 --machine_rank R --main_process_ip <node0_ip>
# --main_process_port 29500`), the same command on each node with its rank:
#   node 0: NNODES=2 NODE_RANK=0 MASTER_ADDR=<node0_ip> MASTER_PORT=29500 scripts/train_flow_rtpo.sh 8
#   node 1: NNODES=2 NODE_RANK=1 MASTER_ADDR=<node0_ip> MASTER_PORT=29500 scripts/train_flow_rtpo.sh 8
# NPROC is the processes PER NODE (accelerate's --num_processes is the total: alignkit computes it). bf16 comes
# from model.dtype (auto = bf16 on GPUs that have it), not from --mixed_precision. Writes models/flow_rtpo
# (relative to the current directory; pass output_dir=... to change it): final/ (the attacker),
# final_image_policy/ (the image policy's LoRA), attacks.jsonl (every attack, answer, score and both rewards).
# CONFIG picks another recipe; LAUNCHER=torchrun (or deepspeed) instead of accelerate; PYTHON the interpreter.
# A thin wrapper over `alignkit launch`.
set -euo pipefail
NPROC="${1:?usage: $0 NPROC [key=value ...]}"
shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$(cd "$HERE/../configs" && pwd)/flow_rtpo.yaml}"
LAUNCHER="${LAUNCHER:-accelerate}"
source "$HERE/_launch_args.sh"
exec "$PYTHON" -m alignkit launch --nproc-per-node "$NPROC" ${LAUNCH_ARGS[@]+"${LAUNCH_ARGS[@]}"} \
  "$CONFIG" "output_dir=models/flow_rtpo" "$@"
