"""On-policy distillation against SFT on the teacher's samples, on the shipped digits task (issue 47's claim: a
student distilled from a trained teacher closes most of the teacher's lead, faster than SFT on the teacher's
samples).

Once: the tiny Llama, SFT on ``builtin:digits_sft_train.jsonl`` (``configs/sft_digits.yaml``: the student's start
S0) and the teacher T: S0 SFT'd further (150 steps, the same recipe) on the training prompts with their right
bare answers (``builtin:digits_prompts_train.jsonl``). Not the GRPO teacher of ``configs/distill.yaml``'s header:
that one (``configs/grpo.yaml`` from S0, 60 iterations) scored 0.024 against S0's 0.005 on this evaluator, a lead
within the evaluator's noise, so nothing could be said of closing it. Then per
seed, from S0, the same N optimizer steps of 64 completions (prompts of ``builtin:digits_prompts_train.jsonl``,
up to 8 new tokens, temperature 1, Adam at 3e-4 constant, the distill recipe's):

- **distill**: ``configs/distill.yaml`` (reverse KL to T on the student's own samples);
- **sft**: SFT on completions T sampled (temperature 1, the seed's draws) for the same prompts, one per example,
  64 per step: the same number of completions, each at most 8 tokens, as the student samples when distilling
  (the token counts are recorded).

Each arm saves a checkpoint every N/3 steps; every checkpoint, S0 and T are scored by one evaluator here: 8
sampled completions (temperature 1, the same draws for every model) of each of the 100 held-out
``builtin:digits_prompts_eval.jsonl`` prompts, exact match (greedy decoding is no measure here: the GRPO teacher
answers "9" to every held-out prompt greedily). The fraction of the teacher's lead closed at a checkpoint is (acc - acc(S0)) / (acc(T) - acc(S0)).
One thread per run, two runs at a time. Results: ``benchmarks/results/learn-distill-<date>.json`` and ``.md``.

    python benchmarks/learn_distill.py --seeds 3 --steps 60
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
THREADS = 1
BATCH = 64
MAX_NEW = 8
LR = 3e-4
EVAL_SEED = 1234
#: SFT steps of the teacher on the training prompts' answers (batch 32: ~5 epochs of the 1,000 prompts)
TEACHER_STEPS = 150
#: two-sided 97.5% quantile of Student's t by degrees of freedom (a 95% CI of a mean over seeds)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def builtin(name: str) -> Path:
    return REPO / "src" / "alignkit" / "resources" / "data" / name


def train(config: str | None, overrides: list[str]) -> None:
    """One alignkit run in this process (a child): one thread."""
    import torch

    torch.set_num_threads(THREADS)
    from alignkit.config import load_config
    from alignkit.train.runner import run_train

    run_train(load_config(config, [*overrides, "logging.plot=false", "logging.report_to=[jsonl]"]))


def child_prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """The tiny model, S0 (SFT on the digits chat rows) and T (S0 SFT'd further on the training prompts' right
    bare answers), seed 0."""
    from alignkit.models.tiny import build_tiny_model

    work = Path(spec["work"])
    if (work / "teacher_sft" / "final" / "config.json").is_file():  # a rerun in the same folder: the same S0 and T
        return {"student": f"{work}/s0/final", "teacher": f"{work}/teacher_sft/final"}
    if not (work / "s0" / "final" / "config.json").is_file():
        base = build_tiny_model(work / "base", size="tiny", seed=0)
        train(str(REPO / "configs" / "sft_digits.yaml"), [f"model.name_or_path={base}", f"output_dir={work}/s0"])
    answers = work / "teacher_rows.jsonl"
    answers.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                                        {"role": "assistant", "content": r["answer"]}]}) + "\n"
                               for r in map(json.loads, builtin("digits_prompts_train.jsonl").read_text().splitlines())))
    train(str(REPO / "configs" / "sft_digits.yaml"), [
        f"model.name_or_path={work}/s0/final", f"data.train={answers}", f"output_dir={work}/teacher_sft",
        f"training.max_steps={TEACHER_STEPS}"])
    return {"student": f"{work}/s0/final", "teacher": f"{work}/teacher_sft/final"}


def child_distill(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    train(str(REPO / "configs" / "distill.yaml"), [
        f"model.name_or_path={spec['student']}", f"distill.teacher={spec['teacher']}", f"output_dir={spec['out']}",
        f"training.max_steps={spec['steps']}", f"training.seed={spec['seed']}", "data.eval=[]",
        f"checkpoint.save_steps={spec['every']}", "checkpoint.save_total_limit=null", "rollout.log_samples=0",
        f"training.per_device_batch_size={BATCH}", f"rollout.max_new_tokens={MAX_NEW}", f"training.learning_rate={LR}",
        "logging.logging_steps=1"])
    rows = [json.loads(x) for x in (Path(spec["out"]) / "metrics.jsonl").read_text().splitlines()]
    lengths = [r["completion_length"] for r in rows if "completion_length" in r]
    return {"seconds": time.perf_counter() - t0,
            "completion_tokens": sum(lengths) * BATCH if len(lengths) == spec["steps"] else None}


def child_sft(spec: dict[str, Any]) -> dict[str, Any]:
    """Sample T's completions (temperature 1, this seed's draws) for the prompts distillation would draw, then SFT."""
    rows, tokens = teacher_samples(spec["teacher"], spec["steps"] * BATCH, spec["seed"])
    data = Path(spec["out"] + ".jsonl")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    t0 = time.perf_counter()
    train(str(REPO / "configs" / "sft_digits.yaml"), [
        f"model.name_or_path={spec['student']}", f"data.train={data}", f"output_dir={spec['out']}",
        "data.packing=false", f"training.per_device_batch_size={BATCH}", f"training.learning_rate={LR}",
        "training.lr_scheduler=constant", "training.warmup_steps=0", f"training.max_steps={spec['steps']}",
        f"training.seed={spec['seed']}", f"checkpoint.save_steps={spec['every']}", "checkpoint.save_total_limit=null",
        "logging.logging_steps=10"])
    return {"seconds": time.perf_counter() - t0, "completion_tokens": tokens}


def teacher_samples(teacher: str, n: int, seed: int) -> tuple[list[dict[str, Any]], int]:
    """``n`` chat rows: the training prompts in a seeded order (cycled), each with one completion of T."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    prompts = [json.loads(x)["prompt"] for x in builtin("digits_prompts_train.jsonl").read_text().splitlines()]
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    picked = [prompts[order[i % len(order)]] for i in range(n)]
    tok = AutoTokenizer.from_pretrained(teacher)
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    rows, tokens = [], 0
    for start in range(0, n, 256):
        texts, lengths = generate(model, tok, picked[start:start + 256], sample=True)
        tokens += sum(lengths)
        rows += [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
                 for p, c in zip(picked[start:start + 256], texts)]
    return rows, tokens


def generate(model: Any, tok: Any, prompts: list[str], *, sample: bool) -> tuple[list[str], list[int]]:
    """Completions (up to MAX_NEW tokens, cut at EOS) and their token counts; left-padded batch."""
    import torch

    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        how = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
        out = model.generate(**batch, **how, max_new_tokens=MAX_NEW, pad_token_id=pad)
    new = out[:, batch["input_ids"].shape[1]:]
    lengths = [int(((row != pad) & (row != tok.eos_token_id)).sum()) + int((row == tok.eos_token_id).any())
               for row in new]
    return tok.batch_decode(new, skip_special_tokens=True), lengths


def accuracy(path: str, samples: int = 8) -> float:
    """Sampled exact match on the 100 held-out prompts: ``samples`` completions each at temperature 1 (as the
    policies sample in training), the same random draws for every model (common random numbers), compared as
    ``reward.functions: exact_match`` compares."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    rows = [json.loads(x) for x in builtin("digits_prompts_eval.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    right = 0
    for k in range(samples):
        torch.manual_seed(EVAL_SEED + k)
        texts, _ = generate(model, tok, [r["prompt"] for r in rows], sample=True)
        right += sum(t.strip() == str(r["answer"]).strip() for t, r in zip(texts, rows))
    return right / (samples * len(rows))


def child_eval(spec: dict[str, Any]) -> dict[str, Any]:
    return {p: accuracy(p) for p in spec["paths"]}


CHILDREN = {"prepare": child_prepare, "distill": child_distill, "sft": child_sft, "eval": child_eval}


def run_child(kind: str, spec: dict[str, Any], log: Path) -> dict[str, Any]:
    """``kind`` in a fresh interpreter (this checkout's src first; one thread); its JSON answer."""
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO / 'benchmarks'}", "OMP_NUM_THREADS": str(THREADS),
           "MKL_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
    answer = log.with_suffix(".answer.json")
    with log.open("w") as fh:
        proc = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec), str(answer)], env=env,
                              stdout=fh, stderr=subprocess.STDOUT, cwd=str(log.parent), check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed (exit {proc.returncode}); its log: {log}")
    return json.loads(answer.read_text())


def checkpoint_model(run: str, step: int) -> str:
    """The trained model's folder of ``run``'s checkpoint at ``step`` (the role that is not the teacher)."""
    folders = [p.parent for p in sorted((Path(run) / f"checkpoint-{step}").glob("*/config.json"))
               if p.parent.name != "teacher"]
    assert len(folders) == 1, folders
    return str(folders[0])


def mean_ci(xs: list[float]) -> dict[str, float]:
    """Mean over seeds and the half-width of its 95% t interval."""
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else math.nan
    return {"mean": mean, "ci95": T975.get(n - 1, 1.96) * sd / math.sqrt(n) if n > 1 else math.nan, "n": n}


def summarize(acc: dict[str, float], runs: list[dict[str, Any]], steps: list[int]) -> dict[str, Any]:
    s0, t = acc["student"], acc["teacher"]
    lead = t - s0
    out: dict[str, Any] = {"student_acc": s0, "teacher_acc": t, "teacher_lead": lead, "by_step": {}}
    for step in steps:
        row: dict[str, Any] = {}
        for arm in ("distill", "sft"):
            accs = [r[arm]["acc"][str(step)] for r in runs]
            row[arm] = {"acc": mean_ci(accs), "closed": mean_ci([(a - s0) / lead for a in accs])}
        row["distill_minus_sft_closed"] = mean_ci([(r["distill"]["acc"][str(step)] - r["sft"]["acc"][str(step)]) / lead
                                                   for r in runs])
        out["by_step"][str(step)] = row
    return out


def fmt(x: dict[str, float]) -> str:
    return f"{x['mean']:+.3f} ± {x['ci95']:.3f}" if not math.isnan(x["ci95"]) else f"{x['mean']:+.3f}"


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"# On-policy distillation vs SFT on the teacher's samples ({result['date']})", "",
             f"{result['setup']}", "",
             (f"Held-out sampled accuracy (100 prompts x 8 samples): student start S0 {s['student_acc']:.3f}, teacher T "
              f"{s['teacher_acc']:.3f}, lead {s['teacher_lead']:+.3f}. Fraction of the lead closed, mean ± 95% CI "
              f"over {len(result['runs'])} seeds (paired: the same seed's two arms):"), "",
             "| step | distill acc | SFT acc | distill: lead closed | SFT: lead closed | distill - SFT (closed) |",
             "|---|---|---|---|---|---|"]
    for step, row in s["by_step"].items():
        lines.append(f"| {step} | {fmt(row['distill']['acc'])} | {fmt(row['sft']['acc'])} | "
                     f"{fmt(row['distill']['closed'])} | {fmt(row['sft']['closed'])} | "
                     f"{fmt(row['distill_minus_sft_closed'])} |")
    lines += ["", "Per seed (accuracy at each checkpoint; completion tokens the student trained on; seconds):", "",
              "| seed | distill | SFT | distill tokens | SFT tokens | distill s | SFT s |", "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['seed']} | {r['distill']['acc']} | {r['sft']['acc']} | {r['distill']['completion_tokens']} "
                     f"| {r['sft']['completion_tokens']} | {r['distill']['seconds']:.0f} | {r['sft']['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        kind, spec, answer = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
        Path(answer).write_text(json.dumps(CHILDREN[kind](spec)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per arm (N)")
    ap.add_argument("--work", default="runs/learn_distill")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = ap.parse_args()
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    models = run_child("prepare", {"work": str(work)}, work / "prepare.log")
    every = a.steps // 3
    steps = [every, 2 * every, a.steps]

    def one(seed: int, arm: str) -> dict[str, Any]:
        spec = {**models, "seed": seed, "steps": a.steps, "every": every, "out": str(work / f"{arm}-{seed}")}
        return run_child(arm, spec, work / f"{arm}-{seed}.log")

    jobs = [(seed, arm) for seed in range(a.seeds) for arm in ("distill", "sft")]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two runs at a time, one thread each
        done = dict(zip(jobs, pool.map(lambda j: one(*j), jobs)))
    paths = [models["student"], models["teacher"]] + [checkpoint_model(str(work / f"{arm}-{seed}"), step)
                                                       for seed, arm in jobs for step in steps]
    acc = run_child("eval", {"paths": paths}, work / "eval.log")
    runs = [{"seed": seed, **{arm: {**done[(seed, arm)], "acc": {
        str(step): acc[checkpoint_model(str(work / f"{arm}-{seed}"), step)] for step in steps}}
        for arm in ("distill", "sft")}} for seed in range(a.seeds)]
    named = {"student": acc[models["student"]], "teacher": acc[models["teacher"]]}
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    result = {"date": date, "runs": runs, "summary": summarize(named, runs, steps), "seconds": time.perf_counter() - t0,
              "setup": f"tiny Llama; S0 = configs/sft_digits.yaml, T = S0 + {TEACHER_STEPS} SFT steps on the training prompts' answers; {a.steps} steps of "
                       f"{BATCH} completions (<= {MAX_NEW} tokens) per arm, Adam lr {LR} constant, {THREADS} thread "
                       f"per run, 2 runs at a time; torch {__import__('torch').__version__}; wall "
                       f"{time.perf_counter() - t0:.0f} s"}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"learn-distill-{date}.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    (out / f"learn-distill-{date}.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))


if __name__ == "__main__":
    main()
