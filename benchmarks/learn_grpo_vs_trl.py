"""Does alignkit's GRPO learn at least as well as TRL's GRPOTrainer? (issue 24) Same SFT'd policy, prompts,
reward, group size, batch, lr and iteration count, over N seeds per side; each side in its own subprocess
(TRL 1.16 in its own virtualenv ``results/.venv-trl``, never a dependency of alignkit).

Setup. Task: single-digit products ("What is 7*8?" -> "56"), not the digit-sum task the tests tune on
(letter reversal from ``data/synth.py`` was tried first: the micro model SFT'd for 500 steps never produced an
exact reversal, 0% reward, no signal). Starting policy (built once, cached in ``results/models/learn-mul``):
the micro Llama (``build_tiny_model(size="micro")``) SFT'd briefly by alignkit on rows that answer in three
forms ("56", "The answer is 56.", "7*8=56") for 100 steps, so a sampled answer is an exact match only part of
the time (3-8% in the first iterations of a smoke run; 300 steps gave 32%, too easy a start).
Reward: ``bench_rewards.exact_answer`` (the stripped completion equals the row's ``answer``).
Both sides: 64 completions per iteration (8 prompts x G=8), AdamW lr 1e-3 constant without warm-up, 60
iterations of one optimizer step, temperature 1.0, ``max_new_tokens`` 12, beta 0, seed s (alignkit
``training.seed``, TRL ``seed``), ``torch.set_num_threads(2)``; everything else each side's own defaults
(TRL's are read from the installed GRPOConfig and recorded in the JSON). Prompt order: alignkit and TRL both
shuffle the same prompt file with their own seeded sampler, so the orders differ between the sides.

Measured per seed: ``reward_mean`` per iteration (alignkit: metrics.jsonl with logging_steps=1; TRL: the mean
of each reward-function call = one iteration), the rise (mean of the last 10 iterations minus the first 10)
and the final reward (mean of the last 10). Per side: mean / min / standard error of the rise; alignkit - TRL
(difference and ratio of the mean rises) with its standard error. Runs alternate alignkit / TRL per seed.
Usage::

    python benchmarks/learn_grpo_vs_trl.py [--seeds 8] [--iterations 60] [--skip-trl] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

RESULT_TAG = "BENCH_RESULT "
THREADS = 2
G = 8
BATCH = 64  # completions per iteration: 8 prompts x G
LR = 1e-3
MAX_NEW = 12
WINDOW = 10
SFT_STEPS = 100
FORMS = ("{p}", "The answer is {p}.", "{x}*{y}={p}")
TRL_DEFAULT_KEYS = ("loss_type", "scale_rewards", "epsilon", "epsilon_high", "top_p", "top_k", "num_iterations",
                    "steps_per_generation", "mask_truncated_completions", "importance_sampling_level",
                    "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon", "optim",
                    "shuffle_dataset", "repetition_penalty", "top_entropy_quantile")


# ====================================================================== data and starting policy
def task_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` draws of (``prompt`` "What is 7*8?", ``answer`` "56", ``sft`` the answer in one of ``FORMS``)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        x, y = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"What is {x}*{y}?", "answer": str(x * y),
                     "sft": rng.choice(FORMS).format(x=x, y=y, p=x * y)})
    return rows


def write_task_data(work: Path) -> dict[str, str]:
    """Prompt rows (``prompt``, ``answer``; seed 1) and SFT chat rows (the answer in one of ``FORMS``; seed 2)."""
    work.mkdir(parents=True, exist_ok=True)
    prompts = [{"prompt": r["prompt"], "answer": r["answer"]} for r in task_rows(500, seed=1)]
    sft = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["sft"]}]}
           for r in task_rows(4000, seed=2)]
    paths = {"prompts": work / "prompts.jsonl", "sft": work / "sft.jsonl"}
    for key, rows in (("prompts", prompts), ("sft", sft)):
        paths[key].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {k: str(v) for k, v in paths.items()}


def child_sft(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the micro Llama and SFT it (alignkit, seed 0): the shared starting policy."""
    sys.path.insert(0, str(REPO / "src"))
    import torch

    torch.set_num_threads(THREADS)
    from alignkit.config import load_config
    from alignkit.models.tiny import build_tiny_model
    from alignkit.train.runner import run_train

    base = build_tiny_model(Path(spec["dir"]) / "base", size="micro", seed=0)
    cfg = load_config(None, [
        "algorithm=sft", f"model.name_or_path={base}", f"output_dir={spec['dir']}/sft", f"data.train={spec['sft']}",
        "data.max_length=64", "data.packing=true", "training.per_device_batch_size=32",
        "training.learning_rate=3e-3", "training.lr_scheduler=cosine", "training.warmup_steps=10",
        f"training.max_steps={SFT_STEPS}", "training.seed=0", "logging.logging_steps=50", "logging.plot=false",
    ])
    run_train(cfg)
    return {"policy": str(Path(spec["dir"]) / "sft" / "final")}


# ====================================================================== children: GRPO
def child_alignkit(spec: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "src"))  # this checkout's alignkit, whatever is installed
    import torch

    torch.set_num_threads(THREADS)
    from alignkit.config import load_config
    from alignkit.train.runner import run_train

    cfg = load_config(None, [
        "algorithm=grpo", f"model.name_or_path={spec['policy']}", f"output_dir={spec['run_dir']}",
        f"data.train={spec['prompts']}", "data.max_length=64", f"rollout.num_generations={G}",
        f"rollout.max_new_tokens={MAX_NEW}", "rollout.temperature=1.0", "rollout.log_samples=0", "grpo.beta=0.0",
        "reward.functions=[{name: 'bench_rewards:exact_answer', weight: 1.0}]",
        f"training.per_device_batch_size={BATCH}", f"training.learning_rate={LR}", "training.lr_scheduler=constant",
        "training.warmup_steps=0", f"training.max_steps={spec['iterations']}", f"training.seed={spec['seed']}",
        "logging.report_to=[jsonl]", "logging.logging_steps=1", "logging.plot=false", "checkpoint.save_final=false",
        *spec.get("overrides", []),
    ])
    t0 = time.perf_counter()
    run_train(cfg)
    seconds = time.perf_counter() - t0
    logged = [json.loads(x) for x in (Path(spec["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    training = {k: getattr(cfg.training, k) for k in ("weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2",
                                                       "adam_epsilon", "lr_scaling")}
    defaults = {"grpo": dataclasses.asdict(cfg.grpo), "rollout": dataclasses.asdict(cfg.rollout), "training": training}
    return {"rewards": [r["reward_mean"] for r in logged if "reward_mean" in r], "seconds": seconds,
            "defaults": json.loads(json.dumps(defaults, default=str))}


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(THREADS)
    import transformers
    import trl
    from bench_grpo import make_trl_trainer
    from bench_rewards import exact_answer

    rewards: list[float] = []

    def reward(prompts: Any, completions: Any, answer: Any = None, **kw: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        scores = exact_answer(prompts, texts, answer=answer)
        rewards.append(sum(scores) / len(scores))  # one call per generation batch = per iteration
        return scores

    trainer = make_trl_trainer(spec, reward, batch=BATCH, max_new=MAX_NEW, lr=LR, steps=spec["iterations"],
                               seed=spec["seed"])
    t0 = time.perf_counter()
    trainer.train()
    defaults = {k: getattr(trainer.args, k) for k in TRL_DEFAULT_KEYS if hasattr(trainer.args, k)}
    return {"rewards": rewards, "seconds": time.perf_counter() - t0,
            "defaults": json.loads(json.dumps(defaults, default=str)),
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}


CHILDREN = {"sft": child_sft, "alignkit": child_alignkit, "trl": child_trl}


# ====================================================================== numbers
def rise_and_final(rewards: list[float], window: int = WINDOW) -> tuple[float, float]:
    """(mean of the last ``window`` minus the first ``window``, mean of the last ``window``); the window
    shrinks to half the series when it is shorter than two windows."""
    k = max(1, min(window, len(rewards) // 2))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return last - first, last


def mean_min_se(xs: list[float]) -> dict[str, float]:
    """Mean, min and the standard error of the mean (sample std / sqrt(n); 0 for one value)."""
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return {"mean": mean, "min": min(xs), "se": math.sqrt(var / n), "n": n}


def compare(a: dict[str, float], t: dict[str, float]) -> dict[str, float]:
    """alignkit - TRL (independent samples: the SEs add in quadrature) and alignkit / TRL (delta method)."""
    diff_se = math.sqrt(a["se"] ** 2 + t["se"] ** 2)
    out = {"diff": a["mean"] - t["mean"], "diff_se": diff_se}
    if t["mean"] > 0 and a["mean"] != 0:  # a ratio only of a positive TRL rise
        ratio = a["mean"] / t["mean"]
        out.update(ratio=ratio, ratio_se=abs(ratio) * math.sqrt((a["se"] / a["mean"]) ** 2 + (t["se"] / t["mean"]) ** 2))
    return out


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    sides = {}
    for side, per_seed in runs.items():
        ok = [r for r in per_seed if r.get("ok") and r.get("rewards")]
        for r in ok:
            r["rise"], r["final"] = rise_and_final(r["rewards"])
            r["start"] = rise_and_final(r["rewards"])[1] - r["rise"]
        if ok:
            sides[side] = {"rise": mean_min_se([r["rise"] for r in ok]), "final": mean_min_se([r["final"] for r in ok]),
                           "start": mean_min_se([r["start"] for r in ok]),
                           "minutes_per_run": sum(r["wall_s"] for r in ok) / len(ok) / 60}
    result: dict[str, Any] = {"sides": sides}
    if "alignkit" in sides and "trl" in sides:
        result["alignkit_vs_trl_rise"] = compare(sides["alignkit"]["rise"], sides["trl"]["rise"])
        result["alignkit_vs_trl_final"] = compare(sides["alignkit"]["final"], sides["trl"]["final"])
    return result


def markdown(runs: dict[str, list[dict[str, Any]]], summary: dict[str, Any], head: str) -> str:
    lines = [head, "", "| seed | " + " | ".join(f"{s} start | {s} final | {s} rise" for s in runs) + " |",
             "|---|" + "---|---|---|" * len(runs)]
    for i in range(max(len(v) for v in runs.values())):
        cells = []
        for per_seed in runs.values():
            r = per_seed[i] if i < len(per_seed) else {}
            cells += [f"{r['start']:.3f}", f"{r['final']:.3f}", f"{r['rise']:+.3f}"] if "rise" in r else ["failed"] * 3
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines += ["", "| side | rise mean ± SE | rise min | final mean ± SE | min/run |", "|---|---|---|---|---|"]
    for side, s in summary["sides"].items():
        lines.append(f"| {side} | {s['rise']['mean']:+.3f} ± {s['rise']['se']:.3f} | {s['rise']['min']:+.3f} | "
                     f"{s['final']['mean']:.3f} ± {s['final']['se']:.3f} | {s['minutes_per_run']:.1f} |")
    c = summary.get("alignkit_vs_trl_rise")
    if c:
        ratio = f"; ratio {c['ratio']:.2f} ± {c['ratio_se']:.2f}" if "ratio" in c else ""
        lines += ["", f"alignkit - TRL, rise: {c['diff']:+.3f} ± {c['diff_se']:.3f}{ratio}"]
    return "\n".join(lines)


# ====================================================================== parent
def ensure_policy(out: Path, data: dict[str, str]) -> str:
    """The shared SFT'd starting policy, built once under ``out/models/learn-mul``."""
    from bench_sft_dpo import log, run_child

    root = out / "models" / "learn-mul"
    final = root / "sft" / "final"
    if not (final / "config.json").exists():
        log(f"building and SFT-ing the starting policy in {root} (once)")
        res = run_child(sys.executable, "sft", {"dir": str(root), "sft": data["sft"]}, root / "sft.log", 3600,
                        script=Path(__file__))
        if not res["ok"]:
            raise RuntimeError(f"SFT failed: {res['error']} (see {res['log']})")
    return str(final)


def run_all(a: argparse.Namespace, out: Path, work: Path) -> dict[str, list[dict[str, Any]]]:
    from bench_sft_dpo import ensure_trl_venv, log, run_child

    data = write_task_data(work)
    policy = ensure_policy(out, data)
    sides = {"alignkit": sys.executable}
    if not a.skip_trl:
        sides["trl"] = str(ensure_trl_venv(out / ".venv-trl"))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for seed in range(a.seeds):
        for side, python in sides.items():  # alternate the sides per seed
            spec = {"policy": policy, "prompts": data["prompts"], "iterations": a.iterations, "seed": seed,
                    "run_dir": str(work / f"{side}-{seed}"), "overrides": a.alignkit_override}
            res = run_child(python, side, spec, work / f"{side}-{seed}.log", 3 * 3600, script=Path(__file__))
            log(f"{side} seed {seed}: " + (f"{res['wall_s'] / 60:.1f} min" if res["ok"] else res["error"]))
            runs[side].append(res)
    return runs


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # a subprocess: --child KIND SPEC
        print("\n" + RESULT_TAG + json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
        return
    ap = argparse.ArgumentParser(description="GRPO learning, alignkit vs TRL (see the module docstring)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 seeds x 4 iterations (a smoke test)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--alignkit-override", action="append", default=[], metavar="KEY=VALUE",
                    help="an alignkit config override on top of its defaults (repeatable), e.g. grpo.loss_aggregation=token_mean")
    a = ap.parse_args()
    if a.quick:
        a.seeds, a.iterations = 2, 4
    out = Path(a.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = out / "work" / f"learn-grpo-{stamp}"
    runs = run_all(a, out, work)
    summary = summarize(runs)
    head = (f"# GRPO learning, alignkit vs TRL: single-digit products, micro Llama SFT'd, {BATCH} completions/iteration "
            f"(G={G}), lr {LR:g}, {a.iterations} iterations, {a.seeds} seeds ({stamp}); rise = mean reward_mean of "
            f"the last {WINDOW} iterations - the first {WINDOW}")
    text = markdown(runs, summary, head)
    print(text)
    meta = {"setup": {"task": "single-digit multiplication", "forms": FORMS, "G": G, "batch": BATCH, "lr": LR, "max_new_tokens": MAX_NEW,
                      "iterations": a.iterations, "seeds": a.seeds, "window": WINDOW, "sft_steps": SFT_STEPS,
                      "prompt_order": "each side shuffles the same prompt file with its own seeded sampler"},
            "alignkit_overrides": a.alignkit_override,
            "defaults": {s: next((r.get("defaults") for r in v if r.get("ok")), None) for s, v in runs.items()},
            "versions": next((r.get("versions") for r in runs.get("trl", []) if r.get("ok")), None)}
    (out / f"learn-grpo-{stamp}.json").write_text(json.dumps({**meta, "summary": summary, "runs": runs}, indent=1),
                                                  encoding="utf-8")
    (out / f"learn-grpo-{stamp}.md").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
