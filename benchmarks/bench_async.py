"""Asynchronous GRPO on CPU: ``rollout.placement: separate`` (1 generator + 1 trainer process) at
``rollout.max_staleness`` k = 1, 2, 4 against the synchronous colocated loop (1 process), on the same cores.

The workload: GRPO on the BASELINES ``tiny`` Llama (random init, fp32), single-digit sum prompts, ``--group`` G
completions per prompt (8), ``--batch`` completions per iteration (one optimizer step each; ``--batch / --group``
prompts), ``--max-new`` tokens (random weights rarely stop early: every completion is about that long), a
digit-fraction reward (``bench_rewards.digit_fraction``), lr 1e-6 constant. Two shapes: the default (32
completions of 16 tokens: a batch-bound rollout) and a decode-bound one (``--batch 8 --max-new 64``: few rows,
long decoding, the shape whose phases gain little from a second thread, where the overlap should pay); pick one
where the colocated run's generate and update seconds are comparable (both are printed).
Cores: the colocated process gets ``--threads`` threads (2); each process of a separate run gets
``--threads / 2`` (1), so both sides use the same cores; a colocated run of 1 thread is reported beside (on a
loaded machine 2 threads can be slower than 1; ``--no-1thread`` skips it).

Measured per run, over the timed iterations (after ``--warmup``): seconds per iteration (between consecutive
lines of metrics.jsonl, one per iteration), and for the separate runs the trainer's idle fraction (waiting for
completions + the weight broadcast, ``async/trainer_wait_s`` + ``async/weight_sync_s``, per iteration second) and
the generator's (waiting for weights, ``async/generator_idle_s``), the mean staleness. A second table breaks each
run's iteration into phases (means of the ``time/*`` and ``async/*`` seconds): the colocated loop's generate,
score, update and rest; a separate run's trainer (waiting, weight push, update, rest) and generator (weights,
sampling, behaviour log-probs, scoring, pickling the sends). Every mean of ``time/*`` and ``async/*`` goes to the
JSON. Usage::

    python benchmarks/bench_async.py [--warmup 2 --timed 10] [--ks 1,2,4] [--out benchmarks/results]
    python benchmarks/bench_async.py --batch 8 --max-new 64 --ks 1      # the decode-bound shape
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_prompts(path: Path, n: int = 400) -> Path:
    rows = [{"prompt": f"What is {i % 10}+{(i * 7) % 10}?", "answer": str(i % 10 + (i * 7) % 10)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def overrides(args: argparse.Namespace, model: Path, prompts: Path, out: Path) -> list[str]:
    spi = steps_per_iteration(args.set)
    return [
        "algorithm=grpo", f"model.name_or_path={model}", f"output_dir={out}", f"data.train={prompts}",
        f"data.max_length={max(64, args.max_new + 32)}", f"rollout.num_generations={args.group}", f"rollout.max_new_tokens={args.max_new}",
        "rollout.log_samples=0", "reward.functions=[{name: 'bench_rewards:digit_fraction', weight: 1.0}]",
        f"training.per_device_batch_size={args.batch}", "training.learning_rate=1e-6", "training.lr_scheduler=constant",
        f"training.max_steps={spi * (args.warmup + args.timed)}", "training.seed=0", "logging.report_to=[jsonl]",
        "logging.logging_steps=1", "logging.plot=false", "checkpoint.save_final=false", "distributed.strategy=single",
        *args.set,
    ]


def steps_per_iteration(extra: list[str]) -> int:
    """Optimizer steps per iteration the ``--set`` overrides ask for (rollout.update_epochs x mini_batches)."""
    given = dict(x.split("=", 1) for x in extra)
    return int(given.get("rollout.update_epochs", 1)) * int(given.get("rollout.mini_batches", 1))


def run(args: argparse.Namespace, model: Path, prompts: Path, out: Path, k: int | None,
        threads: int | None = None) -> dict[str, Any]:
    """One run (k None: colocated, 1 process of ``threads`` threads; else separate, 1 trainer + 1 generator of
    ``--threads / 2`` each) and its numbers."""
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    threads = threads or (args.threads if k is None else max(1, args.threads // 2))
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cfg = overrides(args, model, prompts, out)
    cmd = [sys.executable, "-m", "alignkit", "train"]
    if k is not None:
        cfg += ["rollout.placement=separate", f"rollout.max_staleness={k}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "-m", "alignkit", "train"]
    yaml = out.parent / f"{out.name}.yaml"
    yaml.write_text("algorithm: grpo\n")
    start = time.perf_counter()
    proc = subprocess.run([*cmd, str(yaml), *cfg], env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"run {out.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    timed = rows[args.warmup:]
    stamps = [r["time"] for r in rows]
    per_it = [b - a for a, b in zip(stamps[args.warmup - 1 :], stamps[args.warmup:])] if args.warmup else []
    seconds = sum(per_it) / max(1, len(per_it))

    def mean(key: str) -> float:
        vals = [r[key] for r in timed if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    res = {"k": k, "threads_per_process": threads, "s_per_iteration": seconds, "wall_s": time.perf_counter() - start,
           "generate_s": mean("time/generate_s"), "update_s": mean("time/update_s"), "reward_mean": mean("reward_mean"),
           "phases": {key: mean(key) for key in sorted({x for r in timed for x in r})
                      if key.startswith(("time/", "async/")) and key.endswith("_s")}}
    if k is not None:
        res.update(trainer_idle=(mean("async/trainer_wait_s") + mean("async/weight_sync_s")) / seconds,
                   generator_idle=mean("async/generator_idle_s") / seconds,
                   generator_generate_s=mean("async/generator_generate_s"), staleness_mean=mean("staleness/mean"))
    return res


#: the phase table's columns: (header, the ``time/*`` / ``async/*`` key of the per-iteration seconds)
TRAINER_PHASES = (("wait", "async/trainer_wait_s"), ("push", "async/weight_sync_s"), ("update", "time/update_s"))
GENERATOR_PHASES = (("weights", "async/generator_idle_s"), ("sample", "async/generator_sample_s"),
                    ("behav. logps", "async/generator_behaviour_logps_s"), ("score", "async/generator_score_s"),
                    ("send", "async/generator_send_s"))


def phase_table(results: list[dict[str, Any]]) -> str:
    """Seconds per iteration by phase: a colocated run's generate / score / update / the rest of the iteration; a
    separate run's trainer (waiting for completions, pushing weights, update, the rest) and generator phases."""
    head = ["run", "s / it", "generate", "score", *(h for h, _ in TRAINER_PHASES), "trainer rest",
            *(f"gen. {h}" for h, _ in GENERATOR_PHASES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        ph, it = r["phases"], r["s_per_iteration"]
        name = f"colocated, {r['threads_per_process']} threads" if r["k"] is None else f"separate k={r['k']}"
        cells = [ph.get("time/generate_s", math.nan), ph.get("time/score_s", math.nan)]
        cells += [ph.get(key, math.nan) for _, key in TRAINER_PHASES]
        known = sum(x for x in cells if not math.isnan(x)) - (cells[0] if r["k"] is not None else 0.0)
        cells.append(it - known)  # a separate run's generate phase is its wait (already counted)
        cells += [ph.get(key, math.nan) for _, key in GENERATOR_PHASES]
        lines.append(f"| {name} | {it:.3f} | " + " | ".join("-" if math.isnan(x) else f"{x:.3f}" for x in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=10)
    p.add_argument("--ks", default="1,2,4")
    p.add_argument("--batch", type=int, default=32, help="completions per iteration (a multiple of --group)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (rollout.num_generations)")
    p.add_argument("--no-1thread", dest="one_thread", action="store_false", help="skip the 1-thread colocated run")
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="repeat colocated + separate runs, interleaved")
    p.add_argument("--size", default="tiny", help="the built-in Llama's size (alignkit.models.tiny_base.SIZES)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (e.g. rollout.update_epochs=2: more update per generation)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    if args.batch % args.group:
        p.error(f"--batch {args.batch} is not a multiple of --group {args.group}")
    sys.path.insert(0, str(REPO / "src"))
    from alignkit.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / args.size, size=args.size, seed=0)
        prompts = write_prompts(root / "prompts.jsonl")
        rounds = []
        for i in range(args.rounds):  # interleaved: a slow minute of a noisy machine hits both sides of a round
            results = [run(args, model, prompts, root / f"colocated-{i}", None)]
            if args.one_thread and i == 0:
                results.append(run(args, model, prompts, root / "colocated-1thread", None, threads=1))
            for k in [int(x) for x in args.ks.split(",") if x]:
                results.append(run(args, model, prompts, root / f"separate-k{k}-{i}", k))
            rounds.append(results)
    tables = [run_table(results) for results in rounds]
    summary = rounds_table(rounds) if len(rounds) > 1 else ""
    text = "\n\n".join(f"round {i + 1}\n\n{t}" if len(rounds) > 1 else t for i, t in enumerate(tables))
    text = f"{summary}\n\n{text}" if summary else text
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
            "workload": f"{args.size} Llama, {args.batch // args.group} prompts x {args.group}, {args.max_new} new tokens"}
    (args.out / f"async-{stamp}.json").write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1))
    (args.out / f"async-{stamp}.md").write_text(f"# bench_async {stamp}\n\n{meta['workload']}; load average at the "
                                                f"end: {meta['load_avg']}\n\n{text}\n")


def run_table(results: list[dict[str, Any]]) -> str:
    """One round's runs (the first: the colocated 2-thread baseline of its speed-ups) and their phases."""
    base = results[0]["s_per_iteration"]
    lines = ["| run | s / iteration | speed-up | generate s | update s | trainer idle | generator idle | staleness |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = f"colocated (sync), {r['threads_per_process']} threads" if r["k"] is None else f"separate k={r['k']}"
        gen = r.get("generator_generate_s", r["generate_s"])
        lines.append(f"| {name} | {r['s_per_iteration']:.3f} | {base / r['s_per_iteration']:.2f}x | {gen:.3f} | "
                     f"{r['update_s']:.3f} | {r.get('trainer_idle', float('nan')):.2f} | "
                     f"{r.get('generator_idle', float('nan')):.2f} | {r.get('staleness_mean', 0.0):.2f} |")
    return "\n".join(lines) + "\n\n" + phase_table(results)


def ceiling(colocated: dict[str, Any], separate: dict[str, Any]) -> float:
    """The speed-up of a perfect overlap: the colocated iteration's generate + update seconds (2 threads) over the
    longer of the separate run's two phases (1 thread each)."""
    slow = max(separate["generator_generate_s"], separate["update_s"])
    return (colocated["generate_s"] + colocated["update_s"]) / slow


def rounds_table(rounds: list[list[dict[str, Any]]]) -> str:
    """Each separate run's speed-up over its own round's colocated run, per round, with the median and range, and
    the perfect overlap's speed-up (:func:`ceiling`) beside it."""
    ks = [r["k"] for r in rounds[0] if r["k"] is not None]
    lines = ["| run | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " | median | min | max |",
             "|---|" + "---|" * (len(rounds) + 3)]
    for k in ks:
        pairs = [(rs[0], next(r for r in rs if r["k"] == k)) for rs in rounds]
        ups = [c["s_per_iteration"] / s["s_per_iteration"] for c, s in pairs]
        tops = [ceiling(c, s) for c, s in pairs]
        for name, xs in ((f"separate k={k}", ups), (f"perfect overlap, k={k}", tops),
                         (f"k={k}: measured / perfect", [u / t for u, t in zip(ups, tops)])):
            unit = "" if "/" in name else "x"
            cells = " | ".join(f"{x:.2f}{unit}" for x in xs)
            lines.append(f"| {name} | {cells} | {statistics.median(xs):.2f}{unit} | {min(xs):.2f}{unit} | "
                         f"{max(xs):.2f}{unit} |")
    return ("Speed-up over the same round's colocated run (rounds interleaved), and a perfect overlap's: the "
            "colocated generate + update seconds over the longer of the separate run's phases:\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
