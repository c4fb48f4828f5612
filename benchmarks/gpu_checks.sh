#!/bin/bash
# The gpu-marked tests on one GPU machine without network, in one go (issue 38 item 8, issue 49 parts 1-2): bf16
# against fp32, packed varlen == padded, no host sync in steady state (set_sync_debug_mode), the bf16 steps of
# GRPO / PPO / KTO / ORPO / Safe-MM-DPO / VLM / Flow-GRPO, LoRA on a bf16 base, gradient checkpointing, FSDP2 and
# ZeRO-2/3 with one rank over NCCL (save, exact resume), the start-up GPU memory line, the estimator within 15% of
# the measured peak, Liger against the built-in head.
#   OUT=$OUT bash benchmarks/gpu_checks.sh [WHEELS_DIR | -]      (from the project root; -: install nothing)
#   GPU_CHECKS_DRY=1 OUT=/tmp/x bash benchmarks/gpu_checks.sh -   (on CPU: every gpu test skips; checks OUT)
# Work (installed wheels, pytest's temporary folders) goes to $SCRATCH; OUT receives only gpu-tests.log (each
# test's outcome as it happens, every failure's full traceback: --tb=long, set_sync_debug_mode names the op) and
# gpu-tests.xml (JUnit). Exits with pytest's status.
set -u
WHEELS=${1:--}
OUT=${OUT:-/tmp/gpu-checks}; SCRATCH=${SCRATCH:-/tmp/alignkit-gpu-checks}; SITE=$SCRATCH/site
mkdir -p "$OUT" "$SCRATCH"
LOG=$OUT/gpu-tests.log
: >"$LOG"
if [ "$WHEELS" != "-" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl \
    >"$SCRATCH/pip.log" 2>&1 || { echo "pip install of $WHEELS failed:"; tail -20 "$SCRATCH/pip.log"; } | tee -a "$LOG"
fi
export PYTHONPATH=$PWD/src:$SITE:$PWD/benchmarks:${PYTHONPATH:-} PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'| transformers', transformers.__version__, '| peft', peft.__version__)"; } | tee -a "$LOG"
# never run on a GPU first (issue 49: a run cut short must spend its minutes on them), then the ones that failed
# there (packed rows through torch's varlen_attn), then the rest
export GPU_TESTS_FIRST="
  tests/integration/test_gpu_engines.py::test_one_rank_nccl_save_and_exact_resume
  tests/integration/test_gpu_engines.py::test_startup_log_prints_the_gpu_memory_line
  tests/unit/train/test_gpu_bf16.py
  tests/integration/test_gpu_steps.py
  tests/unit/models/test_packed_attention.py::test_gpu_packed_varlen_equals_padded_in_bf16
  tests/integration/test_gpu_engines.py::test_steady_state_steps_do_not_sync
"
# only the files holding gpu-marked tests (collecting every test module would import optional packages)
FILES=$(grep -rl --include='test_*.py' "mark.gpu" tests | sort)
# pyproject's addopts ask for pytest-xdist: not needed (nor installed) here. -v and pytest_instafail: each test's
# outcome, and a failure's traceback, are in the log as they happen (a run cut by its time limit keeps them)
timeout -k 10 "${GPU_CHECKS_TIMEOUT:-420}" python3 -m pytest -o addopts="" -p no:cacheprovider -p pytest_instafail \
  -p pytest_gpu_order -v --tb=long -rA -m gpu --basetemp "$SCRATCH/pytest" --junitxml "$OUT/gpu-tests.xml" $FILES \
  2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [ -n "${GPU_CHECKS_DRY:-}" ]; then  # the layout a GPU machine returns: exactly these two files
  got=$(cd "$OUT" && ls | tr '\n' ' ')
  [ "$got" = "gpu-tests.log gpu-tests.xml " ] || { echo "dry run: OUT holds $got" | tee -a "$LOG"; exit 1; }
  echo "dry run: OUT holds $got" | tee -a "$LOG"
fi
exit "$rc"
