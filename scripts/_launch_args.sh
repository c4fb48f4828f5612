# Sourced by the train_*.sh scripts: turns the multi-node environment variables users already
# export (torchrun's names) into `alignkit launch` options. Unset variables keep alignkit's defaults
# (one node; port 29500, or a free one when 29500 is taken on a single node). Expand the array
# as ${LAUNCH_ARGS[@]+"${LAUNCH_ARGS[@]}"}: bash 3.2 (macOS) calls an empty array unbound under set -u.
LAUNCH_ARGS=()
if [[ -n "${NNODES:-}" ]]; then LAUNCH_ARGS+=(--nnodes "$NNODES"); fi
if [[ -n "${NODE_RANK:-}" ]]; then LAUNCH_ARGS+=(--node-rank "$NODE_RANK"); fi
if [[ -n "${MASTER_ADDR:-}" ]]; then LAUNCH_ARGS+=(--master-addr "$MASTER_ADDR"); fi
if [[ -n "${MASTER_PORT:-}" ]]; then LAUNCH_ARGS+=(--master-port "$MASTER_PORT"); fi
if [[ -n "${LAUNCHER:-}" ]]; then LAUNCH_ARGS+=(--launcher "$LAUNCHER"); fi
PYTHON="${PYTHON:-python}"
