"""SUPERSEDED by ``learn_addition.py`` (issue 47): this task mostly measures whether a policy learns to answer "0"
(a constant "0" policy scores 0.19 with the shared evaluator, the trained finals 0.08-0.22; on the 64 products
without a 0 or 1 factor every policy, either side, is right 0-2% of the time), its per-seed numbers change with
the thread count, and its recorded alignkit lead came from one collapsed TRL seed (16 seeds: equal within noise).
Kept for its ``--probe`` (do both sides sample alike at iteration 0?) and the earlier results it produced.

Does alignkit's GRPO learn at least as well as TRL's GRPOTrainer? (issue 24) Same SFT'd policy, prompts,
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
(TRL's are read from the installed GRPOConfig and recorded in the JSON). Prompt order: the SAME on both sides
for a seed: alignkit's ``GlobalOrder`` and TRL's ``RepeatSampler`` both take ``torch.randperm(500)`` from a
``torch.Generator`` seeded with the seed (checked: identical in both environments), so seed s trains on the same
prompts in the same order on both sides and only the sampling draws differ: compare the sides seed by seed.

Measured per seed: ``reward_mean`` per iteration (alignkit: metrics.jsonl with logging_steps=1; TRL: the mean
of each reward-function call = one iteration), the rise (mean of the last 10 iterations minus the first 10)
and the final reward (mean of the last 10); per side also the mean over seeds of each 10-iteration window
(the learning curve) and of iteration 0 alone, the only one sampled before any update (the first window
holds nine updates at lr 1e-3 already, so a run that dips early shows a low start and a larger rise). Per side: mean / min / standard error of the rise; alignkit - TRL
(difference and ratio of the mean rises) with its standard error. Runs alternate alignkit / TRL per seed
(``--jobs N``: N children at once). Per seed and side, diagnostics from each side's own per-iteration logs
(``DIAG_ALIGNKIT`` / ``DIAG_TRL``; TRL is run with ``logging_steps=1`` for them): the share of clipped tokens,
the share of zero-std groups, entropy and completion length at the start and the end, the gradient norm
before clipping and the share of steps it exceeded ``max_grad_norm`` 1.0.

``--probe EPOCHS``, the iteration-0 check: do both sides sample from the same distribution before any
update? Each side runs its own trainer on 64 distinct products (``probe-prompts.jsonl``) for EPOCHS whole
epochs at lr 1e-30 (an AdamW step of ~1e-30 moves no float32 weight), scoring with
``bench_rewards.exact_answer_recorded``; the parent compares the prompts' token ids (alignkit's prompt
pipeline against TRL's ``_tokenize_prompts``), the mean reward of every sampled completion per side, the
per-prompt difference, completion lengths and TRL's generation config.
Usage::

    python benchmarks/learn_grpo_vs_trl.py [--seeds 8] [--iterations 60] [--skip-trl | --skip-alignkit] [--quick] [--jobs N] [--out benchmarks/results]
        [--alignkit-override KEY=VALUE ...] [--trl-override FIELD=VALUE ...]
    python benchmarks/learn_grpo_vs_trl.py --probe 4 --seeds 4   # iteration 0: 4 x 512 completions per seed and side
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

import policy_eval  # noqa: E402  (benchmarks/ is on the path above)

RESULT_TAG = "BENCH_RESULT "
THREADS = 2
G = 8
BATCH = 64  # completions per iteration: 8 prompts x G
LR = 1e-3
MAX_NEW = 12
WINDOW = 10
SFT_STEPS = 100
PROBE_PROMPTS = 64  # --probe: distinct prompts (8 iterations per epoch)
EVAL_SEED = 0  # the evaluator's draws: the same for every policy (common random numbers)
PROBE_LR = 1e-30  # --probe: an AdamW step of ~lr changes no float32 weight: sampling stays at iteration 0
FORMS = ("{p}", "The answer is {p}.", "{x}*{y}={p}")
TRL_DEFAULT_KEYS = ("loss_type", "scale_rewards", "epsilon", "epsilon_high", "top_p", "top_k", "num_iterations",
                    "steps_per_generation", "mask_truncated_completions", "importance_sampling_level",
                    "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon", "optim",
                    "shuffle_dataset", "repetition_penalty", "top_entropy_quantile")
#: per-iteration diagnostics, each side's logged name: the share of trained tokens whose ratio was clipped, the
#: token-mean entropy of the sampling distribution, the share of groups whose G rewards are all equal (no
#: gradient), the mean completion length in tokens, the gradient norm before clipping (max_grad_norm 1.0)
DIAG_ALIGNKIT = {"clip": "clip_fraction", "entropy": "entropy", "zero_std": "frac_reward_zero_std",
                 "length": "completion_length", "grad_norm": "grad_norm"}
DIAG_TRL = {"clip": "clip_ratio/region_mean", "entropy": "entropy", "zero_std": "frac_reward_zero_std",
            "length": "completions/mean_length", "grad_norm": "grad_norm"}


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
    """Build the micro Llama and SFT it (alignkit, seed 0): the shared starting policy (``spec``'s ``steps``,
    ``warmup`` and ``threads`` override ``SFT_STEPS``, 10 and ``THREADS``: ``learn_addition.py`` uses it too)."""
    sys.path.insert(0, str(REPO / "src"))
    import torch

    torch.set_num_threads(spec.get("threads", THREADS))
    from alignkit.config import load_config
    from alignkit.models.tiny import build_tiny_model
    from alignkit.train.runner import run_train

    base = build_tiny_model(Path(spec["dir"]) / "base", size="micro", seed=0)
    cfg = load_config(None, [
        "algorithm=sft", f"model.name_or_path={base}", f"output_dir={spec['dir']}/sft", f"data.train={spec['sft']}",
        "data.max_length=64", "data.packing=true", "training.per_device_batch_size=32",
        "training.learning_rate=3e-3", "training.lr_scheduler=cosine", f"training.warmup_steps={spec.get('warmup', 10)}",
        f"training.max_steps={spec.get('steps', SFT_STEPS)}", "training.seed=0", "logging.logging_steps=50",
        "logging.plot=false",
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
        f"reward.functions=[{{name: 'bench_rewards:{spec.get('reward', 'exact_answer')}', weight: 1.0}}]",
        f"training.per_device_batch_size={BATCH}", f"training.learning_rate={spec.get('lr', LR)}",
        "training.lr_scheduler=constant",
        "training.warmup_steps=0", f"training.max_steps={spec['iterations']}", f"training.seed={spec['seed']}",
        "logging.report_to=[jsonl]", "logging.logging_steps=1", "logging.plot=false",
        f"checkpoint.save_final={str(bool(spec.get('save_final'))).lower()}",
        *spec.get("overrides", []),
    ])
    t0 = time.perf_counter()
    run_train(cfg)
    seconds = time.perf_counter() - t0
    logged = [json.loads(x) for x in (Path(spec["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    training = {k: getattr(cfg.training, k) for k in ("weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2",
                                                       "adam_epsilon", "lr_scaling")}
    defaults = {"grpo": dataclasses.asdict(cfg.grpo), "rollout": dataclasses.asdict(cfg.rollout), "training": training}
    rows = [r for r in logged if "reward_mean" in r]
    return {"rewards": [r["reward_mean"] for r in rows], "seconds": seconds,
            "diag": {k: [r.get(src, math.nan) for r in rows] for k, src in DIAG_ALIGNKIT.items()},
            "defaults": json.loads(json.dumps(defaults, default=str))}


def child_trl(spec: dict[str, Any], probe: Any = None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(THREADS)
    import bench_rewards
    import transformers
    import trl
    from bench_grpo import make_trl_trainer

    rewards: list[float] = []
    score = getattr(bench_rewards, spec.get("reward", "exact_answer"))

    def reward(prompts: Any, completions: Any, answer: Any = None, **kw: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        scores = score(prompts, texts, answer=answer)
        rewards.append(sum(scores) / len(scores))  # one call per generation batch = per iteration
        return scores

    # one log per step, for the per-iteration diagnostics (logging reads metrics; it draws no random number)
    spec = {**spec, "trl_overrides": {"logging_steps": 1, **spec.get("trl_overrides", {})}}
    trainer = make_trl_trainer(spec, reward, batch=BATCH, max_new=MAX_NEW, lr=spec.get("lr", LR),
                               steps=spec["iterations"], seed=spec["seed"])
    t0 = time.perf_counter()
    trainer.train()
    if spec.get("save_final"):  # the final policy, for the shared evaluator (policy_eval.py)
        trainer.save_model(str(Path(spec["run_dir"]) / "final"))
    defaults = {k: getattr(trainer.args, k) for k in TRL_DEFAULT_KEYS if hasattr(trainer.args, k)}
    rows = [r for r in trainer.state.log_history if "reward" in r]
    out = {"rewards": rewards, "seconds": time.perf_counter() - t0,
           "diag": {k: [r.get(src, math.nan) for r in rows] for k, src in DIAG_TRL.items()},
           "defaults": json.loads(json.dumps(defaults, default=str)),
           "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}
    return {**out, **probe(trainer)} if probe else out


# ====================================================================== children: the iteration-0 probe
def probe_prompts(work: Path) -> str:
    """``PROBE_PROMPTS`` distinct products (a fixed draw of the 100) in one file: ``--probe`` runs whole
    epochs of it, so both sides sample every prompt equally often and the means compare prompt for prompt."""
    pairs = [(x, y) for x in range(10) for y in range(10)]
    random.Random(3).shuffle(pairs)
    path = work / "probe-prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {x}*{y}?", "answer": str(x * y)}) + "\n"
                            for x, y in pairs[:PROBE_PROMPTS]), encoding="utf-8")
    return str(path)


def probe_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A probe run: the recording reward and a learning rate too small to move a float32 weight."""
    return {**spec, "reward": "exact_answer_recorded", "lr": PROBE_LR}


def child_probe_alignkit(spec: dict[str, Any]) -> dict[str, Any]:
    """alignkit's sampling before any update: every scored completion, and each prompt's token ids as
    alignkit's prompt pipeline renders them."""
    import bench_rewards
    from transformers import AutoTokenizer

    bench_rewards.RECORD = []
    out = child_alignkit(probe_spec(spec))  # puts this checkout's src on sys.path
    from alignkit.data.prompts import prompt_text

    tok = AutoTokenizer.from_pretrained(spec["policy"])
    prompts = [json.loads(x)["prompt"] for x in Path(spec["prompts"]).read_text().splitlines()]
    ids = {p: tok(prompt_text(tok, p), add_special_tokens=False)["input_ids"] for p in prompts}
    return {**out, "record": bench_rewards.RECORD, "prompt_ids": ids}


def child_probe_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's sampling before any update: every scored completion, each prompt's token ids as TRL
    tokenises them (``_tokenize_prompts``) and the generation config it samples with."""
    import bench_rewards

    bench_rewards.RECORD = []
    prompts = [json.loads(x)["prompt"] for x in Path(spec["prompts"]).read_text().splitlines()]

    def probe(trainer: Any) -> dict[str, Any]:
        ids = trainer._tokenize_prompts([[{"role": "user", "content": p}] for p in prompts])[0]
        return {"record": bench_rewards.RECORD, "prompt_ids": {p: list(i) for p, i in zip(prompts, ids)},
                "generation_config": json.loads(json.dumps(trainer.generation_config.to_diff_dict(), default=str))}

    return child_trl(probe_spec(spec), probe)


def child_eval(spec: dict[str, Any]) -> dict[str, Any]:
    """The shared evaluator (``policy_eval.py``) over ``spec["paths"]``, in alignkit's environment for every side."""
    import torch

    torch.set_num_threads(THREADS)
    return {"evals": {p: policy_eval.evaluate(p, samples=spec["samples"], max_new=MAX_NEW, seed=EVAL_SEED)
                      for p in spec["paths"]}}


CHILDREN = {"sft": child_sft, "alignkit": child_alignkit, "trl": child_trl, "eval": child_eval,
            "probe_alignkit": child_probe_alignkit, "probe_trl": child_probe_trl}


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


def window_means(runs: list[dict[str, Any]], window: int = WINDOW) -> list[float]:
    """The mean over seeds of each ``window``-iteration block's mean reward: the learning curve."""
    n = min(len(r["rewards"]) for r in runs) // window
    return [sum(sum(r["rewards"][i * window:(i + 1) * window]) / window for r in runs) / len(runs) for i in range(n)]


def nanmean(xs: list[float]) -> float:
    vals = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(vals) / len(vals) if vals else math.nan


def seed_diagnostics(diag: dict[str, list[float]], window: int = WINDOW) -> dict[str, float]:
    """One run's diagnostics: the clip fraction, zero-std share and gradient norm over the run, the share of
    steps whose gradient norm exceeded max_grad_norm 1.0 (so clipping shrank the step), and entropy and
    completion length over the first and the last ``window`` iterations (a collapse shows as both falling)."""
    if not diag or not diag.get("entropy"):
        return {}
    window = max(1, min(window, len(diag["entropy"]) // 2))  # as rise_and_final: half a short run
    norms = [x for x in diag["grad_norm"] if not math.isnan(x)]
    return {"clip": nanmean(diag["clip"]), "zero_std": nanmean(diag["zero_std"]), "grad_norm": nanmean(norms),
            "norm_clipped": sum(x > 1.0 for x in norms) / max(1, len(norms)),
            "entropy_first": nanmean(diag["entropy"][:window]), "entropy_last": nanmean(diag["entropy"][-window:]),
            "length_first": nanmean(diag["length"][:window]), "length_last": nanmean(diag["length"][-window:])}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    sides = {}
    for side, per_seed in runs.items():
        ok = [r for r in per_seed if r.get("ok") and r.get("rewards")]
        for r in ok:
            r["rise"], r["final"] = rise_and_final(r["rewards"])
            r["start"] = rise_and_final(r["rewards"])[1] - r["rise"]
            r["diagnostics"] = seed_diagnostics(r.get("diag", {}))
        if ok:
            sides[side] = {"rise": mean_min_se([r["rise"] for r in ok]), "final": mean_min_se([r["final"] for r in ok]),
                           "start": mean_min_se([r["start"] for r in ok]),
                           # iteration 0 is sampled before any update: the same distribution on both sides
                           "iteration0": mean_min_se([r["rewards"][0] for r in ok]), "windows": window_means(ok),
                           "minutes_per_run": sum(r["wall_s"] for r in ok) / len(ok) / 60}
            evaluated = [r for r in ok if "eval_rise" in r]
            if evaluated:  # the shared evaluator's numbers (policy_eval.py)
                sides[side]["eval_start"] = evaluated[0]["eval_start"]
                sides[side]["eval_final"] = mean_min_se([r["eval"]["reward"] for r in evaluated])
                sides[side]["eval_rise"] = mean_min_se([r["eval_rise"] for r in evaluated])
    result: dict[str, Any] = {"sides": sides}
    if "alignkit" in sides and "trl" in sides:
        result["alignkit_vs_trl_rise"] = compare(sides["alignkit"]["rise"], sides["trl"]["rise"])
        result["alignkit_vs_trl_final"] = compare(sides["alignkit"]["final"], sides["trl"]["final"])
        # seed s sees the same prompts in the same order on both sides: the per-seed difference
        for key in ("rise", "final", "eval_rise"):
            pairs = [(a, t) for a, t in zip(runs["alignkit"], runs["trl"]) if key in a and key in t]
            if pairs:
                result[f"paired_{key}"] = mean_min_se([a[key] - t[key] for a, t in pairs])
                result[f"paired_{key}"]["alignkit_higher"] = sum(a[key] > t[key] for a, t in pairs)
    return result


def diagnostics_table(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown lines: per seed and side the rise and the run's diagnostics (``seed_diagnostics``)."""
    lines = ["", ("Per seed and side (diagnostics): clip = share of trained tokens clipped; zero-std = share of groups "
                  "with all-equal rewards (no gradient); entropy and completion length (tokens) over the first -> the "
                  f"last {WINDOW} iterations; |g| = mean gradient norm before clipping, with the share of steps above "
                  "1.0:"), "",
             "| seed | side | rise | clip | zero-std | entropy | length | \\|g\\| (share > 1) |", "|---|---|---|---|---|---|---|---|"]
    for i in range(max(len(v) for v in runs.values())):
        for side, per_seed in runs.items():
            r = per_seed[i] if i < len(per_seed) else {}
            d = r.get("diagnostics")
            if d:
                lines.append(f"| {r.get('seed', i)} | {side} | {r['rise']:+.3f} | {d['clip']:.3f} | {d['zero_std']:.2f} | "
                             f"{d['entropy_first']:.2f} -> {d['entropy_last']:.2f} | {d['length_first']:.1f} -> "
                             f"{d['length_last']:.1f} | {d['grad_norm']:.2f} ({d['norm_clipped']:.2f}) |")
    return lines


def eval_table(runs: dict[str, list[dict[str, Any]]], summary: dict[str, Any]) -> list[str]:
    """Markdown lines: the shared evaluator's reward of each final policy and its rise over the starting policy
    (the same 100 products x K samples and the same random draws for every policy), per seed and per side."""
    sides = {s: v for s, v in summary["sides"].items() if "eval_rise" in v}
    if not sides:
        return []
    start = next(iter(sides.values()))["eval_start"]
    lines = ["", f"Evaluated by one evaluator (policy_eval.py: every product, the same sampled draws for every policy); "
                 f"the starting policy scores {start:.3f}. eval rise = final policy's score - the start's:", "",
             "| seed | " + " | ".join(f"{s} eval | {s} eval rise" for s in sides) + " |", "|---|" + "---|---|" * len(sides)]
    for i in range(max(len(runs[s]) for s in sides)):
        cells = []
        for s in sides:
            r = runs[s][i] if i < len(runs[s]) else {}
            cells += [f"{r['eval']['reward']:.3f}", f"{r['eval_rise']:+.3f}"] if "eval_rise" in r else ["-", "-"]
        lines.append(f"| {runs[next(iter(sides))][i].get('seed', i)} | " + " | ".join(cells) + " |")
    lines += ["", "| side | eval rise mean ± SE | eval rise min | seeds >= +0.05 |", "|---|---|---|---|"]
    for s, v in sides.items():
        n_ok = sum(r.get("eval_rise", -1) >= 0.05 for r in runs[s])
        lines.append(f"| {s} | {v['eval_rise']['mean']:+.3f} ± {v['eval_rise']['se']:.3f} | {v['eval_rise']['min']:+.3f} | "
                     f"{n_ok}/{v['eval_rise']['n']} |")
    d = summary.get("paired_eval_rise")
    if d:
        lines.append(f"\n- paired by seed, alignkit - TRL eval rise: {d['mean']:+.3f} ± {d['se']:.3f}, alignkit higher on "
                     f"{d['alignkit_higher']}/{d['n']} seeds")
    return lines


def markdown(runs: dict[str, list[dict[str, Any]]], summary: dict[str, Any], head: str) -> str:
    lines = [head, "", "| seed | " + " | ".join(f"{s} start | {s} final | {s} rise" for s in runs) + " |",
             "|---|" + "---|---|---|" * len(runs)]
    for i in range(max(len(v) for v in runs.values())):
        cells = []
        for per_seed in runs.values():
            r = per_seed[i] if i < len(per_seed) else {}
            cells += [f"{r['start']:.3f}", f"{r['final']:.3f}", f"{r['rise']:+.3f}"] if "rise" in r else ["failed"] * 3
        seed = next((v[i]["seed"] for v in runs.values() if i < len(v) and "seed" in v[i]), i)
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines += ["", "| side | rise mean ± SE | rise min | final mean ± SE | final min | min/run |", "|---|---|---|---|---|---|"]
    for side, s in summary["sides"].items():
        lines.append(f"| {side} | {s['rise']['mean']:+.3f} ± {s['rise']['se']:.3f} | {s['rise']['min']:+.3f} | "
                     f"{s['final']['mean']:.3f} ± {s['final']['se']:.3f} | {s['final']['min']:.3f} | "
                     f"{s['minutes_per_run']:.1f} |")
    lines += ["", f"mean reward per {WINDOW}-iteration window (over seeds), and of iteration 0 alone (before any update):", ""]
    for side, s in summary["sides"].items():
        lines.append(f"- {side}: " + " ".join(f"{x:.3f}" for x in s["windows"])
                     + f"; iteration 0: {s['iteration0']['mean']:.3f} ± {s['iteration0']['se']:.3f}")
    lines += eval_table(runs, summary)
    lines += diagnostics_table(runs)
    c = summary.get("alignkit_vs_trl_rise")
    if c:
        ratio = f"; ratio {c['ratio']:.2f} ± {c['ratio_se']:.2f}" if "ratio" in c else ""
        f = summary["alignkit_vs_trl_final"]
        lines += ["", f"alignkit - TRL, rise: {c['diff']:+.3f} ± {c['diff_se']:.3f}{ratio}; final reward: "
                      f"{f['diff']:+.3f} ± {f['diff_se']:.3f}"]
        for key in ("rise", "final"):
            d = summary.get(f"paired_{key}")
            if d:
                lines.append(f"- paired by seed (the same prompts), alignkit - TRL {key}: {d['mean']:+.3f} ± {d['se']:.3f}"
                             f", alignkit higher on {d['alignkit_higher']}/{d['n']} seeds")
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


def trl_overrides(items: list[str]) -> dict[str, Any]:
    """``["loss_type=grpo", "epsilon=0.3"]`` -> ``{"loss_type": "grpo", "epsilon": 0.3}`` (JSON, else text)."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def run_all(a: argparse.Namespace, out: Path, work: Path) -> dict[str, list[dict[str, Any]]]:
    from bench_sft_dpo import ensure_trl_venv, log, run_child

    data = write_task_data(work)
    policy = ensure_policy(out, data)
    reused = reuse_runs(a.reuse)
    sides = {} if a.skip_alignkit or "alignkit" in reused else {"alignkit": sys.executable}
    if not a.skip_trl and "trl" not in reused:
        sides["trl"] = str(ensure_trl_venv(out / ".venv-trl"))
    def one(seed: int, side: str) -> dict[str, Any]:
        spec = {"policy": policy, "prompts": data["prompts"], "iterations": a.iterations, "seed": seed,
                "run_dir": str(work / f"{side}-{seed}"), "overrides": a.alignkit_override,
                "trl_overrides": trl_overrides(a.trl_override), "save_final": a.eval_samples > 0}
        res = run_child(sides[side], side, spec, work / f"{side}-{seed}.log", 3 * 3600, script=Path(__file__))
        log(f"{side} seed {seed}: " + (f"{res['wall_s'] / 60:.1f} min" if res["ok"] else res["error"]))
        return {**res, "seed": seed, "run_dir": spec["run_dir"]}

    # alternate the sides per seed; --jobs runs that many children at once (each deterministic per seed)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        seeds = [int(x) for x in a.seed_list.split(",")] if a.seed_list else list(range(a.seeds))
        futures = [(side, pool.submit(one, seed, side)) for seed in seeds for side in sides]
        runs = {side: [f.result() for s, f in futures if s == side] for side in sides}
    runs = {side: reused.get(side) or runs[side] for side in ("alignkit", "trl") if side in runs or side in reused}
    if a.eval_samples > 0:
        evaluate_runs(runs, policy, a.eval_samples, work)
    return runs


def reuse_runs(items: list[str]) -> dict[str, list[dict[str, Any]]]:
    """``--reuse SIDE=FILE``: that side's runs from an earlier result JSON of this script (the same starting policy,
    prompts and settings: the caller's word), their evaluations included; the other side runs now."""
    out = {}
    for item in items:
        side, _, path = item.partition("=")
        runs = json.loads(Path(path).read_text(encoding="utf-8"))["runs"][side]
        out[side] = [{k: v for k, v in r.items() if k not in ("rise", "final", "start", "diagnostics")} for r in runs]
    return out


def evaluate_runs(runs: dict[str, list[dict[str, Any]]], policy: str, samples: int, work: Path) -> None:
    """Score the starting policy and every run's final policy with the one evaluator (``policy_eval.py``, in
    alignkit's environment) and put ``eval`` (the final's), ``eval_start`` and ``eval_rise`` on each run."""
    from bench_sft_dpo import log, run_child

    finals = {id(r): str(Path(r["run_dir"]) / "final") for v in runs.values() for r in v if r.get("ok") and "eval" not in r}
    res = run_child(sys.executable, "eval", {"paths": [policy, *finals.values()], "samples": samples},
                    work / "eval.log", 3 * 3600, script=Path(__file__))
    if not res["ok"]:
        log(f"evaluation failed: {res['error']}")
        return
    start = res["evals"][policy]
    stale = {r["eval_start"] for v in runs.values() for r in v if "eval_start" in r and id(r) not in finals}
    if stale - {start["reward"]}:  # reused runs were scored against another start: the evaluator is not the same
        log(f"warning: reused runs' starting score {sorted(stale)} differs from this evaluation's {start['reward']}")
    for v in runs.values():
        for r in v:
            if id(r) in finals:
                r["eval"] = res["evals"][finals[id(r)]]
                r["eval_start"] = start["reward"]
                r["eval_rise"] = r["eval"]["reward"] - start["reward"]
                r["eval_vs_start"] = mean_min_se([x - y for x, y in zip(r["eval"]["per_product"], start["per_product"])])
    log(f"evaluated {len(finals) + 1} policies ({samples} samples x 100 products each): start {start['reward']:.3f}")


def run_probe(a: argparse.Namespace, out: Path, work: Path) -> dict[str, Any]:
    """``--probe``: both sides sample ``a.probe`` epochs of the probe prompts from the starting policy (no
    update), per seed; compares the prompt token ids and the reward of what they sampled."""
    from bench_sft_dpo import ensure_trl_venv, log, run_child

    data = write_task_data(work)
    policy, prompts = ensure_policy(out, data), probe_prompts(work)
    sides = {"alignkit": sys.executable, "trl": str(ensure_trl_venv(out / ".venv-trl"))}
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for seed in range(a.seeds):
        for side, python in sides.items():
            spec = {"policy": policy, "prompts": prompts, "iterations": a.probe * PROBE_PROMPTS * G // BATCH,
                    "seed": seed, "run_dir": str(work / f"probe-{side}-{seed}"), "overrides": a.alignkit_override}
            res = run_child(python, f"probe_{side}", spec, work / f"probe-{side}-{seed}.log", 3600, script=Path(__file__))
            log(f"probe {side} seed {seed}: " + (f"{len(res['record'])} completions" if res["ok"] else res["error"]))
            if not res["ok"]:
                raise RuntimeError(f"probe {side} failed: {res['error']}")
            runs[side].append(res)
    return runs


def probe_summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per side: the mean reward of every sampled completion (all seeds) with its standard error, the
    completion length in characters, the share of empty completions, the most common completions; the
    prompt-for-prompt difference alignkit - TRL (mean over prompts of the per-prompt mean difference)."""
    per_prompt: dict[str, dict[str, list[float]]] = {}
    sides: dict[str, Any] = {}
    for side, seeds in runs.items():
        rec = [r for res in seeds for r in res["record"]]
        counts: dict[str, int] = {}
        for r in rec:
            per_prompt.setdefault(r["prompt"], {}).setdefault(side, []).append(r["reward"])
            counts[r["completion"]] = counts.get(r["completion"], 0) + 1
        sides[side] = {"reward": mean_min_se([r["reward"] for r in rec]),
                       "chars": sum(len(r["completion"]) for r in rec) / len(rec),
                       "empty": sum(not r["completion"].strip() for r in rec) / len(rec),
                       "top": sorted(counts.items(), key=lambda kv: -kv[1])[:8]}
    both = [v for v in per_prompt.values() if len(v) == len(runs)]
    diffs = [sum(v["alignkit"]) / len(v["alignkit"]) - sum(v["trl"]) / len(v["trl"]) for v in both]
    ids = [res["prompt_ids"] for res in (seeds[0] for seeds in runs.values())]
    return {"sides": sides, "per_prompt_diff": mean_min_se(diffs), "prompts": len(both),
            "same_prompt_ids": all(ids[0].get(p) == ids[1].get(p) for p in ids[0]) and ids[0].keys() == ids[1].keys(),
            "example_prompt_ids": {side: next(iter(res[0]["prompt_ids"].items())) for side, res in runs.items()},
            "trl_generation_config": runs["trl"][0].get("generation_config")}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # a subprocess: --child KIND SPEC
        print("\n" + RESULT_TAG + json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
        return
    ap = argparse.ArgumentParser(description="GRPO learning, alignkit vs TRL (see the module docstring)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-alignkit", action="store_true", help="TRL only (e.g. with --trl-override)")
    ap.add_argument("--quick", action="store_true", help="2 seeds x 4 iterations (a smoke test)")
    ap.add_argument("--jobs", type=int, default=1, help="children run at once (each uses 2 threads)")
    ap.add_argument("--seed-list", default="", metavar="S,S,...",
                    help="these seeds instead of 0..seeds-1 (e.g. 2,6: a weak seed's diagnostics)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--reuse", action="append", default=[], metavar="SIDE=FILE",
                    help="take SIDE's runs (and their evaluations) from an earlier result JSON instead of running them")
    ap.add_argument("--eval-samples", type=int, default=32, metavar="K",
                    help="score the start and every final policy on all 100 products, K samples each, with one "
                         "evaluator for both sides (policy_eval.py); 0: no evaluation, no final models saved")
    ap.add_argument("--alignkit-override", action="append", default=[], metavar="KEY=VALUE",
                    help="an alignkit config override on top of its defaults (repeatable), e.g. grpo.loss_aggregation=token_mean")
    ap.add_argument("--trl-override", action="append", default=[], metavar="FIELD=VALUE",
                    help="a GRPOConfig field on top of TRL's defaults (repeatable; the value read as JSON, else a "
                         "string), e.g. loss_type=grpo")
    ap.add_argument("--probe", type=int, default=0, metavar="EPOCHS",
                    help="only the iteration-0 check: each side samples EPOCHS epochs of 64 distinct prompts x G from "
                         "the starting policy without updating it (per seed); compares prompt ids and rewards")
    a = ap.parse_args()
    if a.probe:
        out = Path(a.out)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        runs = run_probe(a, out, out / "work" / f"learn-grpo-probe-{stamp}")
        summary = probe_summary(runs)
        print(json.dumps(summary, indent=1))
        (out / f"learn-grpo-probe-{stamp}.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1),
                                                            encoding="utf-8")
        return
    if a.quick:
        a.seeds, a.iterations = 2, 4
    out = Path(a.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = out / "work" / f"learn-grpo-{stamp}"
    runs = run_all(a, out, work)
    summary = summarize(runs)
    head = (f"# GRPO learning, alignkit vs TRL: single-digit products, micro Llama SFT'd, {BATCH} completions/iteration "
            f"(G={G}), lr {LR:g}, {a.iterations} iterations, seeds {a.seed_list or f'0-{a.seeds - 1}'} ({stamp}); rise = mean reward_mean of "
            f"the last {WINDOW} iterations - the first {WINDOW}")
    text = markdown(runs, summary, head)
    print(text)
    meta = {"setup": {"task": "single-digit multiplication", "forms": FORMS, "G": G, "batch": BATCH, "lr": LR, "max_new_tokens": MAX_NEW,
                      "iterations": a.iterations, "seeds": a.seeds, "window": WINDOW, "sft_steps": SFT_STEPS,
                      "prompt_order": "the same per seed: torch.randperm(500) from a Generator seeded with the seed, on both sides"},
            "alignkit_overrides": a.alignkit_override, "trl_overrides": trl_overrides(a.trl_override),
            "defaults": {s: next((r.get("defaults") for r in v if r.get("ok")), None) for s, v in runs.items()},
            "versions": next((r.get("versions") for r in runs.get("trl", []) if r.get("ok")), None)}
    (out / f"learn-grpo-{stamp}.json").write_text(json.dumps({**meta, "summary": summary, "runs": runs}, indent=1),
                                                  encoding="utf-8")
    (out / f"learn-grpo-{stamp}.md").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
