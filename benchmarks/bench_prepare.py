"""Data at scale: prepare time, warm-cache start-up and RSS per rank on a generated preference file.

    python benchmarks/bench_prepare.py [--rows 500000] [--out benchmarks/results/prepare] [--skip-list-path]

1. Writes ``--rows`` DPO rows of ``bench_data.make_rows`` (chat messages; prompt+chosen median ~153
   tokens) to ``OUT/pairs.jsonl`` (once; kept for later runs).
2. ``alignkit prepare`` of the whole file with ``data.num_proc=2`` into an empty cache (wall time),
   and of the first ``--slice-rows`` rows with num_proc 1 and 2 (the comparison, on a busy machine).
3. Warm start-up, in fresh processes on the whole file's cache: the time to the training set
   (import, config, tokenizer, memory-mapped examples), and a whole ``alignkit train`` of one step
   (process start to exit), against the same on a 64-row file (an "empty" data set).
4. RSS per rank, under torchrun with 2 processes: after the training set is built and after reading
   200 micro-batches of 8 pairs by the sampler's indices, against the 64-row file (anonymous memory
   and file-backed pages of the memory-mapped cache apart); and the list path
   alignkit had before (every row tokenised into Python lists, in every rank) on the slice.

Prints a table and writes ``OUT/result.json``. Uses the benchmark's ``tiny`` model (vocab 8192).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

#: what a child process runs to report start-up time and RSS (argv: config path, phase, overrides...)
CHILD = r'''
import time; T0 = time.time()
import json, os, sys, psutil
import torch
from alignkit.algorithms import ALGORITHMS
from alignkit.config import load_config
from alignkit.data.sampler import GlobalOrder
from alignkit.distributed import comm
from alignkit.models.loading import load_tokenizer
if "RANK" in os.environ:
    torch.distributed.init_process_group("gloo")
def rss():
    """RSS in MiB: total, anonymous (the process's own memory) and file-backed (pages of memory-mapped
    files, e.g. the Arrow cache: shared by every rank that maps them, reclaimable page cache)."""
    f = {k: int(v.split()[0]) / 1024 for k, v in
         (x.split(":", 1) for x in open("/proc/self/status").read().splitlines() if x.startswith("Rss"))}
    return {"rss": round(psutil.Process().memory_info().rss / 2**20), "anon": round(f.get("RssAnon", 0)),
            "file": round(f.get("RssFile", 0) + f.get("RssShmem", 0))}
cfg = load_config(sys.argv[1], sys.argv[3:], notes=False)
r0 = rss()
algo = ALGORITHMS.get(cfg.algorithm)(cfg, load_tokenizer(cfg.model))
r1 = rss()
T1 = time.time()
if sys.argv[2] == "list":  # the path before the cache: every row tokenised into a list in this process
    from alignkit.data.preference import load_pairs
    d = cfg.data
    train, _ = load_pairs(algo.tokenizer, d.train, max_length=d.max_length, pair="helpful",
                          chat_template=d.chat_template, skip_invalid=False)
else:
    train = algo.data.build_dataset(cfg.data.train, "train")
ready, data_s = time.time() - T0, time.time() - T1
r2 = rss()
order = GlobalOrder(len(train), comm.world_size(), comm.rank(), 8, seed=0)
for k, (idx, _) in enumerate(order.rounds(0)):
    if k == 200:
        break
    algo.data.collate([train[i] for i in idx])
r3 = rss()
print("RESULT " + json.dumps({"rank": comm.rank(), "n": len(train), "ready_s": round(ready, 2), "data_s": round(data_s, 2),
      "mb_before_data": r1, "mb_after_data": r2, "mb_after_reading": r3}),
      flush=True)
'''


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    e["PYTHONPATH"] = str(REPO / "src") + os.pathsep + e.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def run(cmd: list[str], timeout: int = 7200) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=REPO)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return took, proc


def write_rows(path: Path, n: int) -> None:
    from bench_data import make_rows

    if path.is_file() and sum(1 for _ in path.open("rb")) == n:
        return
    with path.open("w", encoding="utf-8") as fh:
        for chunk in range(0, n, 10000):
            for r in make_rows(min(10000, n - chunk), seed=chunk):
                fh.write(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n")


def config(out: Path, model: Path, data: Path, cache: Path) -> Path:
    import yaml

    cfg = {"algorithm": "dpo", "output_dir": str(out / "run"), "model": {"name_or_path": str(model)},
           "data": {"train": str(data), "max_length": 256, "cache_dir": str(cache)},
           "training": {"per_device_batch_size": 8, "max_steps": 1, "learning_rate": 1e-4},
           "logging": {"report_to": ["jsonl"], "plot": False}, "checkpoint": {"save_final": False}}
    path = out / f"{data.stem}-{cache.name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def child(cfg: Path, phase: str, nproc: int = 1) -> list[dict]:
    script = cfg.parent / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    cmd = [sys.executable, str(script), str(cfg), phase]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=29517",
               str(script), str(cfg), phase]
    _, proc = run(cmd)
    return sorted((json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")),
                  key=lambda r: r["rank"])


def prepare(out: Path, model: Path, data: Path, cache: Path, nproc: int) -> float:
    import shutil

    shutil.rmtree(cache, ignore_errors=True)
    took, _ = run([sys.executable, "-m", "alignkit", "prepare", str(config(out, model, data, cache)),
                   f"data.num_proc={nproc}"])
    print(f"prepare {data.name} num_proc={nproc}: {took:.1f}s", flush=True)
    return round(took, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--slice-rows", type=int, default=None,
                   help="rows of the num_proc=1 prepare and of the list path (default --rows; fewer on a busy machine)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "prepare")
    p.add_argument("--skip-list-path", action="store_true", help="do not measure the old list path (slow)")
    p.add_argument("--reuse-warm", action="store_true", help="keep OUT/cache-warm (and its prepare time) if complete")
    p.add_argument("--skip-slice", action="store_true", help="skip the num_proc 1 / 2 comparison on the slice")
    a = p.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from alignkit.models.tiny import build_tiny_model

    model = out / "tiny"
    if not (model / "config.json").is_file():
        build_tiny_model(model, size="tiny", seed=0)
    n_slice = a.slice_rows or a.rows
    big, small, part = out / "pairs.jsonl", out / "pairs64.jsonl", out / f"pairs{n_slice}.jsonl"
    t = time.perf_counter()
    write_rows(big, a.rows)
    write_rows(small, 64)
    write_rows(part, n_slice)
    res: dict = {"rows": a.rows, "slice_rows": n_slice, "generate_s": round(time.perf_counter() - t, 1),
                 "cpus": os.cpu_count(), "load_start": os.getloadavg()}

    def save() -> None:
        res["load_now"] = os.getloadavg()
        (out / "result.json").write_text(json.dumps(res, indent=1), encoding="utf-8")

    warm = out / "cache-warm"
    if a.reuse_warm and any(warm.glob("pairs.jsonl-*/manifest.json")):
        res = {**json.loads((out / "result.json").read_text()), **res}  # keep the earlier prepare time
    else:
        res[f"prepare_{a.rows}_np2_s"] = prepare(out, model, big, warm, 2)
    save()
    cfg_big, cfg_small = config(out, model, big, warm), config(out, model, small, warm)
    run([sys.executable, "-m", "alignkit", "prepare", str(cfg_small)])
    res["startup_big"], res["startup_small"] = child(cfg_big, "cache"), child(cfg_small, "cache")
    res["train_1step_big_s"] = round(run([sys.executable, "-m", "alignkit", "train", str(cfg_big)])[0], 1)
    res["train_1step_small_s"] = round(run([sys.executable, "-m", "alignkit", "train", str(cfg_small)])[0], 1)
    res["ranks_big"], res["ranks_small"] = child(cfg_big, "cache", nproc=2), child(cfg_small, "cache", nproc=2)
    save()
    print(json.dumps(res, indent=1), flush=True)
    for nproc in (1, 2) if not a.skip_slice else ():
        if n_slice != a.rows or nproc == 1:
            res[f"prepare_{n_slice}_np{nproc}_s"] = prepare(out, model, part, out / f"cache-np{nproc}", nproc)
            save()
    if not a.skip_list_path:
        cfg_part = config(out, model, part, warm)
        res["list_path_slice"], res["list_path_small"] = child(cfg_part, "list"), child(cfg_small, "list")
        save()
        print(json.dumps({k: res[k] for k in ("list_path_slice", "list_path_small")}, indent=1))


if __name__ == "__main__":
    main()
