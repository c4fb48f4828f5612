"""Worker: safe_dpo under 2 gloo ranks. One launch checks:

* layout invariance: loss and gradient of one optimizer step over the same 4 rows (responses of
  different lengths, lambda = 2, KL penalty on) agree to 1e-5 for 1 rank x accumulation 4 (and 1 x
  batch 4), computed alone before the process group exists, and 2 ranks x accumulation 2 under DDP;
  once with frozen scores from the frozen models per batch, once with cached scores;
* the multiplier: after several on-policy updates (each rank samples different prompts), lambda,
  J_C and the cost window are identical on both ranks, J_C is the mean over BOTH ranks' samples;
* resume: a fresh algorithm that loads the state saved after update 2 holds it exactly, and its
  update 3 gives exactly the lambda of the uninterrupted run;
* the same two for ``safe_dpo.lambda_update: pid`` (its integral, EMAs and delay queue are state).

Usage: torchrun --nproc_per_node=2 safe_dpo_sync.py MICRO_MODEL HELPFUL_RM COST_MODEL REPORT.json [CONFIG [KEY=VALUE
...] ...]: the configs (train_many.py's arguments) then train one after another in the same launch.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.algorithms.base import Context
from alignkit.config.loader import apply_overrides, build_dataclass
from alignkit.config.schema import RunConfig
from alignkit.distributed import comm
from alignkit.distributed.comm import exit_process
from alignkit.distributed.env import DistEnv, read_env
from alignkit.models.loading import load_tokenizer
from alignkit.train.runner import build_models, strategy_for
from alignkit.train.step import accumulate

CASES = {"per_batch": ["safe_dpo.precompute_scores=false"], "cached": ["safe_dpo.precompute_scores=true"]}
SINGLE = {"1x4": (4, 1), "1x1_ga4": (1, 4)}
DDP = {"2x1_ga2": (1, 2)}


def make_cfg(paths: tuple[str, str, str], over: list[str]) -> RunConfig:
    model, helpful, cost = paths
    raw: dict[str, Any] = {
        "algorithm": "safe_dpo",
        "model": {"name_or_path": model},
        "data": {"train": "builtin:safety_train.jsonl", "max_length": 64},
        "training": {"per_device_batch_size": 1},
        "distributed": {"backend": "gloo"},
        "safe_dpo": {"helpful_model": helpful, "cost_model": cost, "lambda_init": 2.0, "kl_coeff": 0.1,
                     "cost_eval_every": 1, "cost_eval_prompts": 4, "cost_max_new_tokens": 6, "cost_window": 10,
                     "lambda_lr": 0.05, "threshold": -1.0, "sign_check_rows": 0},
    }
    return build_dataclass(RunConfig, apply_overrides(copy.deepcopy(raw), over))


def pick_rows(examples: list[dict[str, Any]], n: int = 4) -> list[dict[str, Any]]:
    """n rows with different response lengths, better != safer in some of them."""
    out, seen = [], set()
    for e in examples:
        key = (len(e["chosen_ids"]), len(e["rejected_ids"]))
        if key[0] != key[1] and key not in seen:
            out.append(e)
            seen.add(key)
        if len(out) == n:
            break
    assert len(out) == n and any(e["better_id"] != e["safer_id"] for e in out), "rows"
    return out


def setup(paths: tuple[str, str, str], over: list[str], env: DistEnv) -> tuple[Any, ...]:
    cfg = make_cfg(paths, over)
    algo = ALGORITHMS.get("safe_dpo")(cfg, load_tokenizer(cfg.model))
    rows = pick_rows(algo.data.build_dataset(cfg.data.train, "train")[:200])
    strategy = strategy_for(cfg, env)
    torch.manual_seed(0)
    models = build_models(workload_of(cfg), cfg.model, strategy, algo.tokenizer,
                          make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    with torch.no_grad():  # move the policy off its reference, identically on every rank
        g = torch.Generator().manual_seed(1)
        for p in strategy.unwrap(models[models.primary]).parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return cfg, algo, strategy, models, rows


def one_step(paths: tuple[str, str, str], case: str, env: DistEnv, per_device: int, ga: int) -> tuple[float, torch.Tensor]:
    _cfg, algo, strategy, models, rows = setup(paths, CASES[case] + [f"training.per_device_batch_size={per_device}",
                                                                     f"training.gradient_accumulation_steps={ga}"], env)
    algo.before_training(Context(models, strategy), rows, [])
    assert ("reward_0" in rows[0]) == (case == "cached")
    mine = rows[env.rank :: env.world_size]
    group = [algo.data.collate(mine[i : i + per_device]) for i in range(0, len(mine), per_device)]
    assert len(group) == ga
    local, _, _ = accumulate(strategy, models, group, algo.loss, algo.data.loss_units, algo.data.tokens_in)
    loss = local[models.primary].detach().to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(loss)
        loss /= env.world_size
    params = [p for p in strategy.unwrap(models[models.primary]).parameters() if p.requires_grad]
    return float(loss), torch.cat([p.grad.reshape(-1) for p in params]).detach().clone()


def multiplier_run(paths: tuple[str, str, str], env: DistEnv, over: list[str]) -> dict[str, Any]:
    """5 updates; the state after update 2 goes into a fresh algorithm which then makes update 3."""
    cfg, algo, strategy, models, rows = setup(paths, over, env)
    ctx = Context(models, strategy)
    algo.before_training(ctx, rows, [])
    states, lambdas, batches = [], [], []
    for step in range(1, 6):
        # sampling is seeded by (seed, estimate, rank): on_step_end draws these same costs again
        batches.append(algo.sample_costs(ctx, step - 1))
        extra = algo.on_step_end(Context(models, strategy, step))
        lambdas.append(extra["lambda"])
        states.append(copy.deepcopy(algo.state_dict()))
    fresh = ALGORITHMS.get("safe_dpo")(cfg, algo.tokenizer)
    fresh.load_state_dict(json.loads(json.dumps(states[1])))  # through JSON, as trainer_state is written
    restored = fresh.state_dict()
    fresh.prompts = algo.prompts
    resumed = fresh.on_step_end(Context(models, strategy, 3))["lambda"]
    return {"lambdas": lambdas, "J_C": [s["multiplier"]["J_C"] for s in states], "final": states[-1],
            "batches": batches, "restored": restored, "saved_2": states[1], "resumed_3": resumed,
            "world": comm.world_size()}


def main(model: str, helpful: str, cost: str, report: str) -> None:
    paths = (model, helpful, cost)
    env = read_env()
    alone = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)
    results: dict[str, dict[str, tuple[float, torch.Tensor]]] = {c: {} for c in CASES}
    for case in CASES:
        for name, (pd, ga) in SINGLE.items():
            results[case][name] = one_step(paths, case, alone, pd, ga)
    strategy_for(make_cfg(paths, []), env).setup()  # the process group (gloo)
    for case in CASES:
        for name, (pd, ga) in DDP.items():
            results[case][name] = one_step(paths, case, env, pd, ga)
    mult = multiplier_run(paths, env, [])
    pid = multiplier_run(paths, env, ["safe_dpo.lambda_update=pid", "safe_dpo.pid_ema_alpha=0.5",
                                      "safe_dpo.pid_d_delay=2"])
    every, every_pid = comm.all_gather_object(mult), comm.all_gather_object(pid)
    if env.rank == 0:
        out: dict[str, Any] = {"cases": {}, "failures": [], "multiplier": mult, "pid": pid}
        for case, by_layout in results.items():
            ref_loss, ref_grad = by_layout["1x4"]
            out["cases"][case] = {}
            for name, (loss, grad) in by_layout.items():
                dl, dg = abs(loss - ref_loss), (grad - ref_grad).abs().max().item()
                out["cases"][case][name] = {"loss": loss, "loss_diff": dl, "grad_diff": dg}
                if dl > 1e-5 or dg > 1e-5:
                    out["failures"].append(f"{case} {name}: |dloss|={dl:.3g} max|dgrad|={dg:.3g}")
            if ref_grad.norm().item() < 1e-4:
                out["failures"].append(f"{case}: gradient ~0, the comparison says nothing")
        a, _b = every
        out["failures"] += check_multiplier(every) + check_multiplier(every_pid, "pid ")
        if "pid" not in every_pid[0]["final"]["multiplier"]:
            out["failures"].append(f"pid state not saved: {every_pid[0]['final']}")
        if a["batches"][0] == a["batches"][0][: len(a["batches"][0]) // 2] * 2:
            out["failures"].append("both ranks sampled the same costs: the sync check says nothing")
        if not all(y > x for x, y in zip(a["lambdas"], a["lambdas"][1:])):
            out["failures"].append(f"lambda should rise while J_C > threshold=-1: {a['lambdas']}")
        with open(report, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1, default=str)
        print("FAILURES:" if out["failures"] else "ALL OK", *out["failures"], sep="\n", flush=True)


def check_multiplier(every: list[dict[str, Any]], what: str = "") -> list[str]:
    """Both ranks' multiplier runs agree; J_C is the mean of both ranks' last costs; resume is exact."""
    a, b = every
    failures = [f"{what}{key} differs between ranks: {a[key]} vs {b[key]}"
                for key in ("lambdas", "J_C", "final", "resumed_3") if a[key] != b[key]]
    window = [c for batch in a["batches"] for c in batch][-10:]
    if abs(sum(window) / len(window) - a["J_C"][-1]) > 1e-9:
        failures.append(f"{what}J_C {a['J_C'][-1]} is not the mean of both ranks' last 10 costs {window}")
    if a["restored"] != a["saved_2"]:
        failures.append(f"{what}restored state {a['restored']} != saved {a['saved_2']}")
    if a["resumed_3"] != a["lambdas"][2]:
        failures.append(f"{what}resumed update 3 gives lambda {a['resumed_3']}, uninterrupted {a['lambdas'][2]}")
    return failures


if __name__ == "__main__":
    main(*sys.argv[1:5])
    if sys.argv[5:]:  # then training runs in the same launch, as workers/train_many.py takes them
        from train_many import main as train_many

        train_many(sys.argv[5:])
    exit_process(0, barrier=True)
