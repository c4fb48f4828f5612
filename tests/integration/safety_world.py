"""The toy safety world's constraint experiments, shared by the Safe-MM-DPO and Lagrangian-PPO learning
tests and runnable by hand over seeds and variants.

A warm start per seed (every stage a real alignkit run through ``run_train``, chat format): SFT of the
micro model on the MORE HELPFUL response of each training row (on harmful prompts often the compliant,
unsafe one), a helpful RM and a cost model (C > 0 = unsafe) on the same rows, and the red-team prompt
set (the training rows' harmful prompts) on which the constraint's J_C is measured. On it:

* ``safe_dpo`` (configs/safe_dpo.yaml): the two frozen scorers, J_C the greedy cost of answers to
  red-team prompts every ``cost_eval_every`` steps;
* ``ppo_lag`` (configs/ppo_lag_rm.yaml with the trained scorers): rollouts on the red-team prompts, reward
  = the helpful RM (it prefers the compliant answer), cost = the cost model, J_C = the mean cost of the
  last ``window`` iterations' samples; the conflict is on every prompt;
* ``judge``: greedy answers to held-out prompts, judged by the program judges and the cost model.

By hand (writes ``OUT/summary.json`` and prints one line per run)::

    python -m tests.integration.safety_world OUT --seeds 0 1 2 3 --runs safe_dpo safe_dpo:safe_rlhf ppo_lag \
        ppo_lag:safe_rlhf,lambda_lr=0.1 [--steps safe_dpo=450 ppo_lag=120]

(a run is ALGO[:VARIANT,...]: shorthands of ``VARIANTS`` or KEY=VALUE keys of the algorithm's section).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from alignkit.config import load_config
from alignkit.data.io import read_rows
from alignkit.data.judges import FORBIDDEN_KEYWORDS, helpfulness, is_refusal, is_unsafe
from alignkit.data.synth import write_rows
from alignkit.resources import resource_path
from tests.conftest import REPO
from tests.integration.test_preference_learning import pinned

N_EVAL = 200
SAMPLES = 4  # sampled answers per held-out harmful prompt in the judge's J_C_sampled
HARMFUL_RE = re.compile(r"\b(" + "|".join(FORBIDDEN_KEYWORDS) + r")\b")
# the shorthands a run name may list after ":" beside KEY=VALUE keys of the algorithm's section
# (e.g. safe_dpo:pid,cost_margin=2)
VARIANTS = {"pid": ("lambda_update=pid",), "gradient": ("lambda_update=gradient",),
            # the Safe RLHF / seed-guide dual (safe_dpo's defaults before the PID ones)
            "safe_rlhf": ("lambda_update=gradient", "cost_margin=0"),
            # ppo_lag: the program judge's unsafe flag (1 / 0) as the cost: J_C = the sampled unsafe rate
            "rate": ("cost_functions=[{name: unsafe, weight: 1.0}]", "cost_model=null")}


def variant(spec: str, algo: str = "safe_dpo") -> tuple[str, ...]:
    """``pid,cost_margin=2`` -> the section keys it sets (safe_rlhf: with safe_dpo's old 128-cost window)."""
    keys = tuple(k for part in spec.split(",") if part for k in VARIANTS.get(part, (part,)))
    return keys + (("cost_window=128",) if algo == "safe_dpo" and "safe_rlhf" in spec.split(",") else ())


def settled(points: list[dict[str, Any]], threshold: float = 0.0) -> dict[str, Any]:
    """The J_C curve after it first met the threshold: how often and how far it left the budget again."""
    j = [p["J_C"] for p in points if p.get("J_C") is not None]
    first = next((i for i, x in enumerate(j) if x <= threshold), None)
    after = j[first:] if first is not None else []
    return {"first_met": None if first is None else points[first]["step"], "final_J_C": j[-1] if j else None,
            "share_out_after": sum(x > threshold for x in after) / len(after) if after else None,
            "max_after": max(after) if after else None}


def harmful(prompt: str) -> bool:
    """A toy-world request for a forbidden act (the judges' rule)."""
    return HARMFUL_RE.search(prompt.lower()) is not None


def train(config: Path | str, overrides: list[str], seed: int) -> float:
    """One run (seconds); a stage whose ``final/`` already exists is kept (re-running one stage by hand)."""
    from alignkit.train.runner import run_train

    out = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")))
    if (out / "final").is_dir():
        return 0.0
    start = time.perf_counter()
    with pinned():
        run_train(load_config(config, [*overrides, f"training.seed={seed}", "logging.report_to=[jsonl]",
                                       "logging.plot=false"]))
    return time.perf_counter() - start


def warm_start(seed: int, out: Path, micro_model: Path) -> dict[str, Any]:
    """SFT policy, helpful RM, cost model and the red-team prompt file of ``seed`` under ``out``."""
    rows = [r.data for r in read_rows("builtin:safety_train.jsonl")]
    sft_rows = [{"messages": [{"role": "user", "content": r["prompt"]},
                              {"role": "assistant", "content": r[f"response_{r['better_response_id']}"]}]} for r in rows]
    sft_file = write_rows(sft_rows, out / "sft_helpful.jsonl")
    # the red-team prompt set the constraint is measured on (Safe RLHF measures J_C on such prompts):
    # over benign prompts too, the strongly negative cost of safe answers would hide the unsafe ones
    red_team = write_rows([{"prompt": p} for p in dict.fromkeys(r["prompt"] for r in rows) if harmful(p)],
                          out / "red_team.jsonl")
    seconds = {"sft": train(resource_path("demo_sft.yaml"), [
        f"model.name_or_path={micro_model}", f"output_dir={out / 'sft'}", f"data.train={sft_file}", "data.eval=[]",
        "training.max_steps=300", "training.learning_rate=5e-3", "training.per_device_batch_size=32"], seed)}
    rm = [f"model.name_or_path={micro_model}", "data.chat_template=true", "data.max_length=128", "data.eval=[]",
          "training.learning_rate=2e-3", "training.max_steps=200"]
    seconds["rm"] = train(REPO / "configs" / "rm_helpful.yaml", [*rm, f"output_dir={out / 'helpful_rm'}"], seed)
    seconds["cm"] = train(REPO / "configs" / "rm_harmless.yaml", [*rm, f"output_dir={out / 'harmless_rm'}"], seed)
    return {"dir": out, "seed": seed, "sft": out / "sft" / "final", "helpful_rm": out / "helpful_rm" / "final",
            "cost_model": out / "harmless_rm" / "final", "red_team": red_team, "seconds": seconds}


def dpo_overrides(ws: dict[str, Any], out: Path, steps: int) -> list[str]:
    return [f"model.name_or_path={ws['sft']}", "data.chat_template=true", "data.max_length=128", "data.eval=[]",
            "dpo.beta=0.1", "dpo.precompute_ref_logps=true", "training.per_device_batch_size=16",
            "training.gradient_accumulation_steps=1", "training.learning_rate=1e-4", f"training.max_steps={steps}",
            "training.epochs=1", "training.eval_batch_size=50", "checkpoint.save_steps=null",
            "checkpoint.save_each_epoch=false", "data.train=builtin:safety_train.jsonl", f"output_dir={out}"]


def run_dpo(ws: dict[str, Any], out: Path, steps: int = 150) -> float:
    return train(REPO / "configs" / "dpo.yaml", [*dpo_overrides(ws, out, steps), "dpo.pair=helpful"], ws["seed"])


def run_safe_dpo(ws: dict[str, Any], out: Path, steps: int = 450, extra: tuple[str, ...] = ()) -> float:
    """configs/safe_dpo.yaml from the warm start; J_C = greedy cost on the red-team prompts every 10 steps."""
    return train(REPO / "configs" / "safe_dpo.yaml", [
        *dpo_overrides(ws, out, steps), f"safe_dpo.helpful_model={ws['helpful_rm']}",
        f"safe_dpo.cost_model={ws['cost_model']}", "safe_dpo.cost_eval_every=10", "safe_dpo.cost_eval_prompts=16",
        "safe_dpo.cost_max_new_tokens=40", f"safe_dpo.cost_prompts={ws['red_team']}", "safe_dpo.cost_do_sample=false",
        *(f"safe_dpo.{e}" for e in extra)], ws["seed"])


def run_ppo_lag(ws: dict[str, Any], out: Path, steps: int = 120, extra: tuple[str, ...] = ()) -> float:
    """configs/ppo_lag_rm.yaml (Safe RLHF's setup: helpful RM reward, cost-model cost, threshold 0) from the
    warm start, on the red-team prompts."""
    return train(REPO / "configs" / "ppo_lag_rm.yaml", [
        f"model.name_or_path={ws['sft']}", f"output_dir={out}", f"data.train={ws['red_team']}", "data.eval=[]",
        f"reward.model={ws['helpful_rm']}", f"ppo_lag.cost_model={ws['cost_model']}", f"training.max_steps={steps}",
        "checkpoint.save_steps=null", *(f"ppo_lag.{e}" for e in extra)], ws["seed"])


def judge(model_dir: Path, cost_model: Path) -> dict[str, Any]:
    """Greedy answers to the held-out prompts: the program judges' unsafe rate on harmful prompts, the cost
    model's view of the same answers (mean C = the greedy J_C, share with C > 0), and on benign prompts
    the answer rate (not a refusal) and mean helpfulness."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignkit.models.scalar import load_scorer
    from alignkit.rewards.scalar import score_responses
    from alignkit.rollout.generate import generate

    prompts = list(dict.fromkeys(r.data["prompt"] for r in read_rows("builtin:safety_eval.jsonl")))[:N_EVAL]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    scorer = load_scorer(cost_model)[0]

    def cost(pairs: list[tuple[str, str]]) -> list[float]:
        return score_responses(scorer, tok, [p for p, _ in pairs], [a for _, a in pairs], chat_template=True,
                               max_length=128, device=torch.device("cpu")).tolist()

    with pinned():
        answers = generate(model, tok, prompts, max_new_tokens=40, batch_size=50)
        bad = [(p, a) for p, a in zip(prompts, answers) if harmful(p)]
        benign = [(p, a) for p, a in zip(prompts, answers) if not harmful(p)]
        costs = cost(bad)
        # the policy's own expected cost (what the constraint bounds): SAMPLES answers per harmful prompt
        many = [p for p, _ in bad for _ in range(SAMPLES)]
        sampled = cost(list(zip(many, generate(model, tok, many, max_new_tokens=40, batch_size=56, do_sample=True))))
    return {"unsafe": sum(is_unsafe(p, a) for p, a in bad) / len(bad), "J_C_greedy": sum(costs) / len(costs),
            "J_C_sampled": sum(sampled) / len(sampled), "cost_positive": sum(c > 0 for c in costs) / len(costs),
            "answered_benign": sum(not is_refusal(a) for _, a in benign) / len(benign),
            "helpfulness_benign": sum(helpfulness(p, a) for p, a in benign) / len(benign),
            "n_harmful": len(bad), "n_benign": len(benign), "examples": [a for _, a in bad[:3]]}


def curve(run: Path, keys: tuple[str, ...] = ("step", "lambda", "J_C", "cost_mean", "reward_mean")) -> list[dict]:
    """The logged rows of ``run`` that carry lambda, reduced to ``keys``."""
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in keys if k in r} for r in log if "lambda" in r]


RUNNERS = {"safe_dpo": run_safe_dpo, "ppo_lag": run_ppo_lag}


def plot_groups(groups: dict[str, list[Path]], out: Path, threshold: float = 0.0) -> Path:
    """One row per group (e.g. a dual rule), lambda and J_C against step, one line per run (seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 2.6 * len(groups)), squeeze=False, sharex=True)
    for row, (label, runs) in zip(axes, groups.items()):
        for i, run in enumerate(runs):
            pts = curve(run)
            for ax, key in zip(row, ("lambda", "J_C")):
                ax.plot([p["step"] for p in pts], [p[key] for p in pts], lw=1.2, label=f"seed {i}")
        row[0].set_ylabel(f"{label}\nlambda")
        row[1].set_ylabel("J_C")
        row[1].axhline(threshold, color="k", ls="--", lw=0.8)
        row[1].legend(fontsize=7, loc="upper right")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    from alignkit.models.tiny import build_tiny_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--runs", nargs="+", default=["safe_dpo", "ppo_lag"])
    p.add_argument("--steps", nargs="*", default=[], help="ALGO=N")
    args = p.parse_args()
    steps = {k: int(v) for k, v in (s.split("=") for s in args.steps)}
    micro = build_tiny_model(args.out / "micro", size="micro", seed=0)
    summary_file = args.out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else []
    for seed in args.seeds:
        ws = warm_start(seed, args.out / f"seed{seed}", micro)
        for name in args.runs:
            algo, _, spec = name.partition(":")
            out = ws["dir"] / re.sub(r"[^\w.-]+", "-", name)
            sec = RUNNERS[algo](ws, out, steps.get(algo, 450 if algo == "safe_dpo" else 120), variant(spec, algo))
            row = {"seed": seed, "run": name, "seconds": round(sec), "judge": judge(out / "final", ws["cost_model"]),
                   "curve": curve(out)}
            row["settled"] = settled(row["curve"])
            summary.append(row)
            summary_file.write_text(json.dumps(summary, indent=1, default=str))
            lam = [c["lambda"] for c in row["curve"]]
            print(json.dumps({"seed": seed, "run": name, **{k: row["judge"][k] for k in (
                "unsafe", "J_C_greedy", "J_C_sampled", "cost_positive", "answered_benign", "helpfulness_benign")},
                "lambda_first_max_last": [round(x, 3) for x in (lam[0], max(lam), lam[-1])], **row["settled"],
                "seconds": row["seconds"]}), flush=True)


if __name__ == "__main__":
    main()
