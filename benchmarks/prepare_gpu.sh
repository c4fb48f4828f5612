#!/bin/bash
# Prepares DEST for bench_gpu.py and gpu_checks.sh on a GPU machine without network: wheels of what such a
# machine may lack (TRL 1.16 and the versions issue 38's table used: transformers 5.23, tokenizers, datasets,
# peft 0.21.2, and their small pure-Python dependencies; for the gpu-marked tests: pytest, liger-kernel and a
# DeepSpeed wheel built here without its C++ ops), for CPython $PY_VERSION (default 3.12) on x86-64 Linux. The
# model, the tokenizer and the data are built on the GPU machine itself (bench_gpu.py; no network needed). Run
# it on any machine with pip, network and torch (DeepSpeed's build imports it), from the project root:
#   bash benchmarks/prepare_gpu.sh .gpu-wheels            (PY_VERSION=3.11 bash ... for a Python 3.11 machine)
# then, on the GPU machine, from the project root (the machine needs torch, accelerate, safetensors, pyarrow,
# pandas, tqdm, pyyaml, jinja2, psutil already; wheels install into a folder of the run, never into its
# site-packages):
#   OUT=$OUT bash benchmarks/gpu_checks.sh .gpu-wheels                 (the gpu-marked tests, <= 5.5 minutes)
#   python3 benchmarks/bench_gpu.py --wheels .gpu-wheels --out $OUT     (--budget seconds)
# .gpu-wheels is git-ignored: a run on a lent GPU machine must name it in its carry list (benchmarks/README.md,
# "The run calls")
set -euo pipefail
DEST=${1:?usage: prepare_gpu.sh DEST}
PY_VERSION=${PY_VERSION:-3.12}
rm -rf "$DEST"; mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)  # absolute: the DeepSpeed wheel is built from another folder
P=(--no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST")
python3 -m pip download -q "${P[@]}" trl==1.16.0 transformers==5.23.0 tokenizers==0.23.3 datasets==5.2.0 peft==0.21.2 \
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
# the gpu-marked tests (gpu_checks.sh): pytest, Liger-Kernel (Triton: comes with a CUDA build of torch), DeepSpeed
python3 -m pip download -q "${P[@]}" pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 liger-kernel==0.8.5 \
  hjson==3.1.0 py-cpuinfo==9.0.0 msgpack==1.2.4 einops==0.8.2 ninja==1.13.2 pydantic==2.14.3 pydantic_core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5
# DeepSpeed ships as a source archive: a pure-Python wheel built here (DS_BUILD_OPS=0; its build imports torch)
T=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary=:all: deepspeed==0.19.8 -d "$T"
(cd "$T" && tar xzf deepspeed-0.19.8.tar.gz && cd deepspeed-0.19.8 && \
  DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation . -w "$DEST")
rm -rf "$T"
ls "$DEST"
du -sh "$DEST"
