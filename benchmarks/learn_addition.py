"""GRPO learning on a task the policy can learn in full (issue 47): two-digit addition, 16 seeds, paired by seed.

Why a new task: ``learn_grpo_vs_trl.py`` (single-digit products) mostly measured whether a policy learns to answer
"0" (a constant "0" scores 0.19 there, the trained finals 0.08-0.22). Here a constant answer scores ~0 (the best
constant's share of the held-out set is computed and recorded: ``constant_policy``), and the start is right most
of the time, so there is room to learn and nothing to game.

Task: "What is 37+48?" -> "85", operands 10..99 (8100 pairs). A fixed held-out set of ``HELD_OUT`` pairs (seed 0
shuffle) never appears in SFT or GRPO rows. Reward: ``bench_rewards.exact_answer`` (the stripped completion equals
the answer). Start: the micro Llama (``build_tiny_model(size="micro")``) SFT'd by alignkit on bare answers for
``SFT_STEPS`` steps (cached in ``results/models/learn-add-<steps>``, git-ignored), tuned to be right ~70% of the
time when sampled at temperature 1 on the held-out set.

GRPO, every run: 8 prompts x G 8 = 64 completions per iteration, ``ITERATIONS`` iterations of one optimizer step,
AdamW lr ``LR`` constant, temperature 1, ``max_new_tokens`` ``MAX_NEW``, beta 0, 1 thread per process, the input
embeddings and block 0 frozen on both sides (``FREEZE``: alignkit's ``model.freeze``, TRL's parameters set to
``requires_grad=False`` before its trainer is built).

Why frozen: the micro Llama SFT'd at lr 3e-3 has small input embeddings (digit rows of norm 0.15-0.44) behind RMSNorm
gains of ~10, so its input side is very sharp. Measured on 64 training sums (2026-11-29, ``probe_sharpness.py``:
the exact gradient of the mean P(right answer), teacher forced): a step along the exact gradient of norm 0.003 /
0.01 / 0.03 / 0.1 moves the mean from 0.496 to 0.504 / 0.511 / 0.475 / 0.179; the same steps with the embeddings and
block 0 left out give 0.498 / 0.501 / 0.510 / 0.533 (0.543 at 0.3). Adam's step at lr 1e-4 is already ~0.04 in norm
over the 0.2M weights, which is why the earlier setting (all weights, lr 1e-4, 30 iterations) left both sides 0.01
below the start and higher rates collapsed them. With the input side frozen, a plain GRPO loop at lr 1e-3 rose from
0.488 to 0.572 / 0.555 (seeds 0 / 1) expected held-out accuracy in 60 iterations.

The held-out metric: ``expected`` is the exact probability of the right completion at temperature 1 (the answer's
tokens and the end of turn, teacher forced: ``policy_eval.expected_accuracy``), what the sampled accuracy estimates
without its sampling noise; ``sampled`` (``EVAL_SAMPLES`` draws per row) and ``greedy`` are reported beside it. Prompt order
is the same per seed on every side (``torch.randperm(500)`` from a Generator seeded with the seed: alignkit's
``GlobalOrder`` and TRL's ``RepeatSampler``). Sides ("variants"): ``sync`` (alignkit, colocated, its defaults),
``trl`` (TRL GRPOTrainer in its own virtualenv, ``loss_type=grpo`` so both average per sequence; the remaining
differences are listed in the JSON under ``differences``), and alignkit variants, each one override set on top
of ``sync`` (``VARIANTS``); ``separate`` ones run 1 trainer + 1 generator process under torchrun (gloo).

Measured per run: the held-out accuracy of the final policy with the shared evaluator (``policy_eval.py``:
``EVAL_SAMPLES`` samples per row at temperature 1 with common random numbers, and greedy), its rise over the start,
the training reward curve. Per variant: mean with a 95% t interval over seeds, and the paired difference to
``sync`` (t over the per-seed differences), seeds where the variant is higher. Usage::

    python benchmarks/learn_addition.py --variants sync,trl --seeds 16 --jobs 2 --trl-python /tmp/h4trlenv/bin/python
    python benchmarks/learn_addition.py --sft-only          # build / check the start (held-out accuracy)
    python benchmarks/learn_addition.py --report FILE.json  # rewrite the .md of a result file
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

RESULT_TAG = "BENCH_RESULT "
THREADS = 1
G = 8
BATCH = 64
LR = 1e-3
ITERATIONS = 60
#: parameters both sides keep frozen (``model.freeze``; TRL: requires_grad off before the trainer is built)
FREEZE = ["embed_tokens", r"layers\.0\."]
MAX_NEW = 6
SFT_STEPS = 600
HELD_OUT = 200
EVAL_SAMPLES = 8
EVAL_SEED = 0
TRAIN_PROMPTS = 500
#: alignkit variants: (config overrides on top of sync, processes)
VARIANTS: dict[str, tuple[list[str], int]] = {
    "sync": ([], 1),
    "separate_k1": (["rollout.placement=separate", "rollout.max_staleness=1"], 2),
    "k4_icepop": (["rollout.placement=separate", "rollout.max_staleness=4", "off_policy.correction=icepop"], 2),
    "k4_none": (["rollout.placement=separate", "rollout.max_staleness=4", "off_policy.correction=none"], 2),
    "k4_token_tis": (["rollout.placement=separate", "rollout.max_staleness=4",
                      "off_policy.correction=token_truncate"], 2),
    "k4_mis": (["rollout.placement=separate", "rollout.max_staleness=4", "off_policy.correction=token_mask"], 2),
    "k4_geo": (["rollout.placement=separate", "rollout.max_staleness=4",
                "off_policy.correction=sequence_geo_mask"], 2),
    "k4_seq_tis": (["rollout.placement=separate", "rollout.max_staleness=4",
                    "off_policy.correction=sequence_truncate"], 2),
    "k4_seq_mis": (["rollout.placement=separate", "rollout.max_staleness=4", "off_policy.correction=sequence_mask"], 2),
    "k2_token_tis": (["rollout.placement=separate", "rollout.max_staleness=2",
                      "off_policy.correction=token_truncate"], 2),
    "k4_gspo": (["rollout.placement=separate", "rollout.max_staleness=4", "grpo.importance_sampling_level=sequence"], 2),
    "k4_cispo": (["rollout.placement=separate", "rollout.max_staleness=4", "grpo.objective=cispo"], 2),
    "dynamic_sampling": (["grpo.dynamic_sampling=true"], 1),
    # two passes over each iteration's samples: the second pass's ratios differ from 1, so clipping acts
    "sync_e2": (["rollout.update_epochs=2"], 1),
    "gspo_e2": (["rollout.update_epochs=2", "grpo.importance_sampling_level=sequence"], 1),
    "cispo_e2": (["rollout.update_epochs=2", "grpo.objective=cispo"], 1),
    "gspo": (["grpo.importance_sampling_level=sequence"], 1),
    "cispo": (["grpo.objective=cispo"], 1),
}
#: two-sided 95% t quantiles by degrees of freedom (df > 30: the normal 1.96)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
       29: 2.045, 30: 2.042}
#: what differs between the sync and trl sides besides the trainer's code (TRL's GRPOConfig defaults, 1.16)
DIFFERENCES = [
    "optimizer: alignkit torch AdamW; TRL optim=adamw_torch_fused (the same update rule, fused kernel)",
    "TRL loss_type set to grpo (per-sequence mean then mean over completions) = alignkit's default sequence_mean",
    ("sampling: both the full distribution (top_k 0, top_p 1, temperature 1); alignkit hf engine, TRL its own "
     "transformers generate call"),
    ("random draws: each side's own sampling stream (alignkit per-completion streams from the seed, TRL the global "
     "torch generator after set_seed): only the prompt order is shared"),
]


# ====================================================================== task
def addition_pairs() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(held-out, training) operand pairs: the 8100 pairs of 10..99 shuffled with seed 0, the first ``HELD_OUT``
    held out."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(0).shuffle(pairs)
    return pairs[:HELD_OUT], pairs[HELD_OUT:]


def row(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"What is {a}+{b}?", "answer": str(a + b)}


def held_out_rows() -> list[tuple[str, str]]:
    return [(r["prompt"], r["answer"]) for r in (row(a, b) for a, b in addition_pairs()[0])]


def constant_policy(rows: list[tuple[str, str]]) -> dict[str, Any]:
    """The best constant answer on ``rows`` and its exact-match accuracy (what answering one number always gets)."""
    counts: dict[str, int] = {}
    for _, answer in rows:
        counts[answer] = counts.get(answer, 0) + 1
    best = max(counts, key=lambda k: (counts[k], k))
    return {"answer": best, "accuracy": counts[best] / len(rows)}


def write_task_data(work: Path, sft_rows: int = 20000) -> dict[str, str]:
    """GRPO prompt rows (``TRAIN_PROMPTS`` training pairs, seed 1) and SFT chat rows (bare answers, seed 2)."""
    work.mkdir(parents=True, exist_ok=True)
    train = addition_pairs()[1]
    rng1, rng2 = random.Random(1), random.Random(2)
    prompts = [row(*rng1.choice(train)) for _ in range(TRAIN_PROMPTS)]
    sft = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]}
           for r in (row(*rng2.choice(train)) for _ in range(sft_rows))]
    paths = {"prompts": work / "prompts.jsonl", "sft": work / "sft.jsonl"}
    for key, rows in (("prompts", prompts), ("sft", sft)):
        paths[key].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {k: str(v) for k, v in paths.items()}


# ====================================================================== numbers
def t_interval(xs: list[float]) -> dict[str, float]:
    """Mean, standard error and the 95% t interval half-width over ``xs`` (n - 1 degrees of freedom)."""
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    se = sd / math.sqrt(n)
    half = T95.get(n - 1, 1.96) * se if n > 1 else math.inf
    return {"mean": mean, "se": se, "ci95": half, "lo": mean - half, "hi": mean + half, "n": n}


def paired(xs: list[float], ys: list[float]) -> dict[str, Any]:
    """``xs - ys`` seed by seed: the t interval of the differences and how many are > 0 / < 0."""
    diffs = [x - y for x, y in zip(xs, ys, strict=True)]
    return {**t_interval(diffs), "higher": sum(d > 0 for d in diffs), "lower": sum(d < 0 for d in diffs)}


# ====================================================================== children (``--child KIND SPEC``)
def child_sft(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the micro Llama and SFT it on bare answers (alignkit, seed 0, 1 thread, cosine lr 3e-3 with 20 warm-up
    steps, batch 32 packed to 64 tokens): ``learn_grpo_vs_trl.child_sft`` with this task's steps."""
    import learn_grpo_vs_trl

    return learn_grpo_vs_trl.child_sft({**spec, "warmup": 20, "threads": THREADS})


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's GRPOTrainer (``bench_grpo.make_trl_trainer``: the matched fields) on the seed; saves the final policy."""
    import torch

    torch.set_num_threads(THREADS)
    import bench_rewards
    import trl
    from bench_grpo import make_trl_trainer

    rewards: list[float] = []

    def reward(prompts: Any, completions: Any, answer: Any = None, **kw: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        scores = bench_rewards.exact_answer(prompts, texts, answer=answer)
        rewards.append(sum(scores) / len(scores))  # one call per generation batch = per iteration
        return scores

    spec = {**spec, "trl_overrides": {"loss_type": "grpo"}, "freeze": FREEZE}
    trainer = make_trl_trainer(spec, reward, batch=BATCH, max_new=MAX_NEW, lr=spec["lr"], steps=spec["iterations"],
                               seed=spec["seed"])
    trainer.train()
    trainer.save_model(str(Path(spec["run_dir"]) / "final"))
    return {"rewards": rewards, "trl": trl.__version__, "optim": str(trainer.args.optim)}


def child_eval(spec: dict[str, Any]) -> dict[str, Any]:
    """The shared evaluator on the held-out sums: sampled (``EVAL_SAMPLES`` per row) and greedy, per policy."""
    import policy_eval
    import torch

    torch.set_num_threads(THREADS)
    rows = held_out_rows()
    out = {}
    for path in spec["paths"]:
        sampled = policy_eval.evaluate(path, samples=EVAL_SAMPLES, max_new=MAX_NEW, seed=EVAL_SEED, rows=rows)
        greedy = policy_eval.evaluate(path, samples=1, max_new=MAX_NEW, seed=EVAL_SEED, rows=rows, greedy=True)
        out[path] = {"sampled": sampled["reward"], "greedy": greedy["reward"], "bare_form": sampled["bare_form"],
                     "expected": policy_eval.expected_accuracy(path, rows)}
    return out


CHILDREN = {"sft": child_sft, "trl": child_trl, "eval": child_eval}


# ====================================================================== parent
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def spawn(cmd: list[str], log_path: Path, timeout: float = 1800) -> dict[str, Any]:
    """Run ``cmd`` with 1 thread per process and this checkout's src + benchmarks/ on the path; its result line."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1",
               PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{HERE}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout)
    wall = time.perf_counter() - t0
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}\n", encoding="utf-8")
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if proc.returncode:
        return {"ok": False, "error": "\n".join(proc.stderr.strip().splitlines()[-5:]), "wall_s": wall}
    return {"ok": True, "wall_s": wall, **(json.loads(lines[-1][len(RESULT_TAG):]) if lines else {})}


def child_cmd(python: str, kind: str, spec: dict[str, Any]) -> list[str]:
    return [python, str(Path(__file__).resolve()), "--child", kind, json.dumps(spec)]


def ensure_policy(out: Path, data: dict[str, str], steps: int) -> str:
    root = out / "models" / f"learn-add-{steps}"
    final = root / "sft" / "final"
    if not (final / "config.json").exists():
        log(f"SFT-ing the starting policy ({steps} steps) in {root} (once)")
        res = spawn(child_cmd(sys.executable, "sft", {"dir": str(root), "sft": data["sft"], "steps": steps}),
                    root / "sft.log", 3600)
        if not res["ok"]:
            raise RuntimeError(f"SFT failed: {res['error']}")
    return str(final)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alignkit_cmd(variant: str, policy: str, prompts: str, run_dir: Path, seed: int, iterations: int,
                 lr: float) -> list[str]:
    """``alignkit train`` for one seed of an alignkit variant (under torchrun for the 2-process ones)."""
    overrides, nproc = VARIANTS[variant]
    yaml = run_dir.parent / f"{run_dir.name}.yaml"
    yaml.parent.mkdir(parents=True, exist_ok=True)
    yaml.write_text("algorithm: grpo\n", encoding="utf-8")
    cfg = [
        f"model.name_or_path={policy}", f"output_dir={run_dir}", f"data.train={prompts}", "data.max_length=64",
        f"rollout.num_generations={G}", f"rollout.max_new_tokens={MAX_NEW}", "rollout.temperature=1.0",
        "rollout.log_samples=0", "grpo.beta=0.0", "reward.functions=[{name: 'bench_rewards:exact_answer', weight: 1.0}]",
        f"training.per_device_batch_size={BATCH}", f"training.learning_rate={lr}", "training.lr_scheduler=constant",
        "training.warmup_steps=0", f"training.max_steps={iterations}", f"training.seed={seed}",
        "logging.report_to=[jsonl]", "logging.logging_steps=1", "logging.plot=false", "distributed.strategy=single",
        "model.freeze=[" + ", ".join(f"'{x}'" for x in FREEZE) + "]", *overrides,
    ]
    head = [sys.executable, "-m", "alignkit", "train"]
    if nproc > 1:
        head = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}", "-m", "alignkit", "train"]
    return [*head, str(yaml), *cfg]


def run_one(a: argparse.Namespace, variant: str, seed: int, policy: str, data: dict[str, str],
            work: Path) -> dict[str, Any]:
    run_dir = work / f"{variant}-{seed}"
    if variant == "trl":
        spec = {"policy": policy, "prompts": data["prompts"], "iterations": a.iterations, "seed": seed,
                "run_dir": str(run_dir), "lr": a.lr}
        res = spawn(child_cmd(a.trl_python, "trl", spec), work / f"{variant}-{seed}.log")
    else:
        res = spawn(alignkit_cmd(variant, policy, data["prompts"], run_dir, seed, a.iterations, a.lr),
                    work / f"{variant}-{seed}.log")
        metrics = run_dir / "metrics.jsonl"
        if res["ok"] and metrics.exists():
            rows = [json.loads(x) for x in metrics.read_text().splitlines()]
            res["rewards"] = [r["reward_mean"] for r in rows if "reward_mean" in r]
    log(f"{variant} seed {seed}: " + (f"{res['wall_s']:.0f} s" if res["ok"] else res["error"]))
    return {**res, "seed": seed, "final": str(run_dir / "final")}


def run_variants(a: argparse.Namespace, policy: str, data: dict[str, str], work: Path) -> dict[str, list[dict]]:
    """Every seed of every variant (``--jobs`` processes at once; a 2-process run counts as 2), then one
    evaluation child over all finals."""
    seeds = list(range(a.seeds))
    runs: dict[str, list[dict[str, Any]]] = {}
    for variant in a.variants:
        jobs = max(1, a.jobs // (VARIANTS[variant][1] if variant in VARIANTS else 1))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            runs[variant] = list(pool.map(lambda s, v=variant: run_one(a, v, s, policy, data, work), seeds))
    finals = [r["final"] for v in runs.values() for r in v if r["ok"]]
    res = spawn(child_cmd(sys.executable, "eval", {"paths": finals}), work / "eval.log", 3600)
    if not res["ok"]:
        raise RuntimeError(f"evaluation failed: {res['error']}")
    for v in runs.values():
        for r in v:
            r["eval"] = res.get(r["final"])
    return runs


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per variant: the t interval of the final held-out accuracy (sampled, greedy) and of the rise over the start;
    paired by seed against ``sync``: the difference's interval and the seeds where the variant is higher."""
    start = result["start"]
    out: dict[str, Any] = {}
    base = {r["seed"]: r for r in result["runs"].get("sync", []) if r.get("eval")}
    for variant, runs in result["runs"].items():
        ok = [r for r in runs if r.get("eval")]
        if not ok:
            continue
        s = {"n_ok": len(ok), "n_failed": len(runs) - len(ok), "minutes_per_run": sum(r["wall_s"] for r in ok) / len(ok) / 60}
        for key in ("expected", "sampled", "greedy"):
            if any(key not in r["eval"] for r in ok) or key not in start:
                continue
            s[key] = t_interval([r["eval"][key] for r in ok])
            s[f"{key}_rise"] = t_interval([r["eval"][key] - start[key] for r in ok])
            both = [r for r in ok if r["seed"] in base]
            if variant != "sync" and len(both) > 1:
                s[f"{key}_vs_sync"] = paired([r["eval"][key] for r in both], [base[r["seed"]]["eval"][key] for r in both])
        out[variant] = s
    return out


def fmt(ci: dict[str, float], signed: bool = False) -> str:
    return f"{ci['mean']:+.3f} ± {ci['ci95']:.3f}" if signed else f"{ci['mean']:.3f} ± {ci['ci95']:.3f}"


def markdown(result: dict[str, Any]) -> str:
    setup, start, summ = result["setup"], result["start"], result["summary"]
    lines = [f"# GRPO learning on two-digit addition ({result['stamp']})", "",
             (f"Start (micro Llama, {setup['sft_steps']} SFT steps), held-out accuracy on {setup['held_out']} sums: "
              f"expected {start['expected']:.3f}, sampled {start['sampled']:.3f}, greedy {start['greedy']:.3f}. Best constant answer "
              f"(\"{setup['constant_policy']['answer']}\"): {setup['constant_policy']['accuracy']:.3f}."),
             (f"Each run: {setup['batch']} completions per iteration (G {setup['G']}), {setup['iterations']} "
              f"iterations, lr {setup['lr']:g}, max_new_tokens {setup['max_new_tokens']}, {setup['threads']} thread "
              "per process. ± = 95% t interval over seeds; paired = variant - sync seed by seed."), "",
             ("| variant | seeds | expected final | expected rise | paired vs sync (expected) | higher / lower | "
              "sampled final | greedy final | paired vs sync (greedy) | min/run |"), "|" + "---|" * 10]
    for variant, s in summ.items():
        p, pg = s.get("expected_vs_sync"), s.get("greedy_vs_sync")
        hl = f"{p['higher']} / {p['lower']}" if p else "-"
        lines.append(f"| {variant} | {s['n_ok']} | {fmt(s['expected'])} | {fmt(s['expected_rise'], True)} | "
                     f"{fmt(p, True) if p else '-'} | {hl} | {fmt(s['sampled'])} | "
                     f"{fmt(s['greedy'])} | {fmt(pg, True) if pg else '-'} | {s['minutes_per_run']:.1f} |")
    lines += ["", "Per seed, expected held-out accuracy of the final policy:", "",
              "| seed | " + " | ".join(summ) + " |", "|---|" + "---|" * len(summ)]
    per = {v: {r["seed"]: r for r in result["runs"][v]} for v in summ}
    for seed in sorted({s for v in per.values() for s in v}):
        cells = [f"{per[v][seed]['eval']['expected']:.3f}" if per[v].get(seed, {}).get("eval") else "-" for v in summ]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines += ["", "sync vs trl, what differs besides the trainers' code:", ""] + [f"- {d}" for d in DIFFERENCES]
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print("\n" + RESULT_TAG + json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="sync,trl", help=f"comma-separated: trl, {', '.join(VARIANTS)}")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=ITERATIONS)
    ap.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--jobs", type=int, default=2, help="processes at once (a 2-process variant's run counts 2)")
    ap.add_argument("--trl-python", default="", help="an interpreter with TRL installed (default: the virtualenv "
                    "bench_sft_dpo.py builds in OUT/.venv-trl)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--result", type=Path, default=None, help="merge into this result JSON (default: today's)")
    ap.add_argument("--sft-only", action="store_true", help="build and evaluate the starting policy only")
    ap.add_argument("--report", type=Path, default=None, help="only rewrite the .md of this result JSON")
    a = ap.parse_args()
    a.variants = [v for v in a.variants.split(",") if v]
    if "trl" in a.variants and not a.trl_python:
        from bench_sft_dpo import ensure_trl_venv

        a.trl_python = str(ensure_trl_venv(a.out / ".venv-trl"))
    if a.report:
        result = json.loads(a.report.read_text())
        a.report.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
        return
    work = a.out / "work" / "learn-addition"
    data = write_task_data(work)
    policy = ensure_policy(a.out, data, a.sft_steps)
    path = a.result or a.out / f"learn-addition-{time.strftime('%Y%m%d')}.json"
    result = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    old = result.get("setup", {})
    if (old.get("sft_steps", a.sft_steps), old.get("lr", a.lr), old.get("iterations", a.iterations)) != (
            a.sft_steps, a.lr, a.iterations):
        raise SystemExit(f"{path} holds runs of other settings ({old}): pass --result")
    ev = spawn(child_cmd(sys.executable, "eval", {"paths": [policy]}), work / "eval-start.log")
    log(f"start: {ev.get(policy)}")
    if a.sft_only:
        return
    result.update(stamp=time.strftime("%Y-%m-%d %H:%M"), start=ev[policy], setup={
        "task": "two-digit addition, operands 10..99", "held_out": HELD_OUT, "train_prompts": TRAIN_PROMPTS,
        "sft_steps": a.sft_steps, "G": G, "batch": BATCH, "lr": a.lr, "iterations": a.iterations,
        "max_new_tokens": MAX_NEW, "threads": THREADS, "freeze": FREEZE, "jobs": a.jobs, "eval_samples": EVAL_SAMPLES,
        "constant_policy": constant_policy(held_out_rows()), "variants": {k: v[0] for k, v in VARIANTS.items()},
        "differences": DIFFERENCES, "cpu_count": os.cpu_count()})
    result["runs"].update(run_variants(a, policy, data, work / time.strftime("%H%M%S")))
    result["summary"] = summarize(result)
    path.write_text(json.dumps(result, indent=1), encoding="utf-8")
    path.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))


if __name__ == "__main__":
    main()
