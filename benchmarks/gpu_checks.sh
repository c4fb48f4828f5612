#!/bin/bash
# The gpu-marked tests on one GPU machine without network, in one go (issue 38, item 8): bf16 against fp32,
# packed varlen == padded, no host sync in steady state (set_sync_debug_mode), LoRA on a bf16 base, gradient
# checkpointing, FSDP2 and ZeRO-2/3 with one rank over NCCL (save, exact resume), the start-up GPU memory line,
# the estimator within 15% of the measured peak, Liger against the built-in head.
#   bash benchmarks/prepare_gpu.sh .gpu-wheels     (on a machine with network)
#   OUT=/some/dir bash benchmarks/gpu_checks.sh .gpu-wheels     (on the GPU machine, from the project root)
# Writes OUT/gpu-tests.log and OUT/gpu-tests.xml (JUnit); exits with pytest's status.
set -u
WHEELS=${1:?usage: gpu_checks.sh WHEELS_DIR}
OUT=${OUT:-/tmp/gpu-checks}; SITE=${GPU_CHECKS_SITE:-/tmp/alignkit-gpu-site}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl \
  >"$OUT/pip.log" 2>&1 || echo "pip install of $WHEELS failed: $OUT/pip.log" | tee -a "$OUT/gpu-tests.log"
export PYTHONPATH=$PWD/src:$SITE:$PWD/benchmarks:${PYTHONPATH:-} PATH=$SITE/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'| transformers', transformers.__version__, '| peft', peft.__version__)"; } | tee -a "$OUT/gpu-tests.log"
# only the files holding gpu-marked tests (collecting every test module would import optional packages)
FILES=$(grep -rl --include='test_*.py' "mark.gpu" tests | sort)
# pyproject's addopts ask for pytest-xdist: not needed (nor installed) here
# -v and pytest_instafail: each test's outcome, and a failure's traceback, are in the log as they happen (a run
# cut by its time limit keeps them; pytest's own summary comes only at the end)
timeout -k 10 "${GPU_CHECKS_TIMEOUT:-480}" python3 -m pytest -o addopts="" -p no:cacheprovider -p pytest_instafail \
  -v --tb=short -rA -m gpu --junitxml "$OUT/gpu-tests.xml" $FILES 2>&1 | tee -a "$OUT/gpu-tests.log"
exit "${PIPESTATUS[0]}"
