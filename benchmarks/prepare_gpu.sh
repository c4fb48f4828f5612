#!/bin/bash
# Prepares DEST for bench_gpu.py on a GPU machine without network: wheels of what such a machine may lack
# (TRL 1.16 and the versions issue 38's table used: transformers 5.23, tokenizers, datasets, peft 0.21.2, and
# their small pure-Python dependencies), for CPython $PY_VERSION (default 3.12) on x86-64 Linux. The model, the
# tokenizer and the data are built on the GPU machine itself (bench_gpu.py; no network needed). Run it on any
# machine with pip and network, from anywhere:
#   bash benchmarks/prepare_gpu.sh .gpu-wheels            (PY_VERSION=3.11 bash ... for a Python 3.11 machine)
# then, on the GPU machine, from the project root (the machine needs torch, accelerate, safetensors, pyarrow,
# pandas, tqdm, pyyaml, jinja2, psutil already; wheels install into the run's folder, never into its site-packages):
#   python benchmarks/bench_gpu.py --wheels .gpu-wheels
set -euo pipefail
DEST=${1:?usage: prepare_gpu.sh DEST}
PY_VERSION=${PY_VERSION:-3.12}
rm -rf "$DEST"; mkdir -p "$DEST"
P=(--no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST")
python3 -m pip download -q "${P[@]}" trl==1.16.0 transformers==5.23.0 tokenizers==0.23.3 datasets==5.2.0 peft==0.21.2 \
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
ls "$DEST"
du -sh "$DEST"
