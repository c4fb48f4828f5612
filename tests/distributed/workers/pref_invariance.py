"""Worker: preference losses are layout-invariant, in ONE launched process group of 2 ranks.

Phase 1 (before the process group exists, every rank alone): loss and gradient of one optimizer
step over the same 4 pairs with 1 rank x batch 4 and 1 rank x accumulation 4; reference
log-probs precomputed by one process; evaluation metrics of one process.
Phase 2 (DDP over gloo): the same step with 2 ranks x batch 2 and 2 ranks x batch 1 x
accumulation 2, precomputation split over 2 ranks, evaluation split over 2 ranks (an odd
number of examples). Rank 0 compares everything (1e-5, fp32) and writes a JSON report.
Usage: torchrun --nproc_per_node=2 pref_invariance.py MICRO_MODEL_DIR REPORT.json
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from alignkit.algorithms.base import Context
from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.config.loader import apply_overrides, build_dataclass
from alignkit.config.schema import RunConfig
from alignkit.distributed.comm import exit_process
from alignkit.distributed.env import DistEnv, read_env
from alignkit.models.loading import load_tokenizer
from alignkit.train.evaluate import evaluate
from alignkit.train.runner import build_models, strategy_for
from alignkit.train.step import accumulate

CASES: dict[str, tuple[str, list[str]]] = {
    "dpo_sigmoid": ("dpo", []),
    "dpo_ipo": ("dpo", ["dpo.loss_type=ipo"]),
    "dpo_simpo_ls": ("dpo", ["dpo.loss_type=simpo", "dpo.beta=2.0", "dpo.label_smoothing=0.1"]),
    "dpo_lora_base": ("dpo", ["model.lora={r: 4, alpha: 8, dropout: 0.0}"]),
    "reward_model": ("reward_model", ["reward_model.margin=0.3", "reward_model.center_coeff=0.01", "reward_model.reg_coeff=0.01"]),
    "cost_model": ("cost_model", ["reward_model.reg_coeff=0.01", "data.train=builtin:safety_train.jsonl"]),
    "orpo": ("orpo", ["orpo.beta=0.5"]),
    # z0 from the KL pairs of the whole step (all micro-batches, all ranks); unequal weights
    "kto": ("kto", ["kto.beta=0.5", "kto.desirable_weight=1.3", "kto.undesirable_weight=0.8",
                    "data.max_train_examples=200"]),
}
# (per_device, accumulation) layouts of the 4 pairs: one process, then two
SINGLE_LAYOUTS = {"1x4": (4, 1), "1x1_ga4": (1, 4)}
DDP_LAYOUTS = {"2x2": (2, 1), "2x1_ga2": (1, 2)}


def make_cfg(model: str, algorithm: str, over: list[str]) -> RunConfig:
    raw: dict[str, Any] = {
        "algorithm": algorithm,
        "model": {"name_or_path": model},
        "data": {"train": "builtin:pref_train.jsonl", "max_length": 64},
        "training": {"per_device_batch_size": 1},
        "distributed": {"backend": "gloo"},
    }
    return build_dataclass(RunConfig, apply_overrides(copy.deepcopy(raw), over))


def pick_pairs(examples: list[dict[str, Any]], n: int = 4) -> list[dict[str, Any]]:
    """n pairs with pairwise different chosen and rejected lengths (KTO: n / 2 desirable then n / 2
    undesirable completions, of different completion and KL-sequence lengths)."""
    if "label" in examples[0]:
        return [e for want in (True, False) for e in distinct([x for x in examples if x["label"] == want], n // 2)]
    return distinct(examples, n)


def distinct(examples: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    out, seen = [], set()
    for e in examples:
        key = (len(e["chosen_ids"]), len(e["rejected_ids"])) if "chosen_ids" in e else \
            (len(e["input_ids"]), len(e["kl_input_ids"]))
        if key[0] != key[1] and key not in seen:
            out.append(e)
            seen.add(key)
        if len(out) == n:
            return out
    raise RuntimeError("not enough pairs of different lengths")


def one_step(model_dir: str, case: str, env: DistEnv, per_device: int, ga: int) -> tuple[float, torch.Tensor]:
    """Global loss and the (synchronised) flat gradient of one optimizer step over the 4 pairs."""
    algorithm, over = CASES[case]
    cfg = make_cfg(model_dir, algorithm, over + [f"training.per_device_batch_size={per_device}",
                                                  f"training.gradient_accumulation_steps={ga}"])
    tok = load_tokenizer(cfg.model)
    algo = ALGORITHMS.get(algorithm)(cfg, tok)
    data = algo.data.build_dataset(cfg.data.train, "train")
    pairs = pick_pairs(data if algorithm == "kto" else data[:200])
    strategy = strategy_for(cfg, env)
    torch.manual_seed(0)  # the same fresh score head everywhere
    models = build_models(workload_of(cfg), cfg.model, strategy, tok,
                          make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    model = models[models.primary]
    with torch.no_grad():  # move the trainable weights off the reference, identically on every rank
        g = torch.Generator().manual_seed(1)
        for p in strategy.unwrap(model).parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn(p.shape, generator=g))
        if algorithm == "kto":  # a peaky random reference, below the policy on the data: z0 > 0, not clamped away
            for name, p in models.frozen["reference"].named_parameters():
                if "lm_head" in name or "embed" in name:
                    p.add_(0.1 * torch.randn(p.shape, generator=g))  # z0 = 1.9 here, not saturated
    mine = pairs[env.rank :: env.world_size]  # ShardedSampler's interleaving, unshuffled
    group = [algo.data.collate(mine[i : i + per_device]) for i in range(0, len(mine), per_device)]
    assert len(group) == ga
    algo.before_step(Context(models, strategy), group)  # KTO's z0 (a no-op for the others)
    local, _, _ = accumulate(strategy, models, group, algo.loss, algo.data.loss_units, algo.data.tokens_in)
    if algorithm == "kto":
        assert float(algo._z0) > 0.01, f"kto: z0 = {float(algo._z0)} (clamped): the case would not test its reduction"
    loss = local[models.primary].detach().to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(loss)
        loss /= env.world_size  # what the loop logs
    params = [p for p in strategy.unwrap(model).parameters() if p.requires_grad]
    grad = torch.cat([p.grad.reshape(-1) for p in params]).detach().clone()
    return float(loss), grad


def precompute_and_eval(model_dir: str, env: DistEnv) -> tuple[list[float], dict[str, float]]:
    """Cached reference log-probs of 7 pairs and eval metrics over 5 (odd: exact-once matters)."""
    cfg = make_cfg(model_dir, "dpo", ["dpo.precompute_ref_logps=true", "training.eval_batch_size=2"])
    algo = ALGORITHMS.get("dpo")(cfg, load_tokenizer(cfg.model))
    data = algo.data.build_dataset(cfg.data.train, "train")[:12]
    train_set, eval_set = data[:7], data[7:12]
    strategy = strategy_for(cfg, env)
    torch.manual_seed(0)
    models = build_models(workload_of(cfg), cfg.model, strategy, algo.tokenizer,
                          make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    model = models[models.primary]
    with torch.no_grad():  # a policy that differs from its reference, identically on every rank
        g = torch.Generator().manual_seed(1)
        for p in strategy.unwrap(model).parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    algo.before_training(Context(models, strategy), train_set, eval_set)
    cached = [e[k] for e in train_set + eval_set for k in ("ref_chosen_logps", "ref_rejected_logps")]
    return cached, evaluate(algo, models, eval_set, strategy, batch_size=2)


def main(model_dir: str, report: str) -> None:
    env = read_env()
    alone = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)
    results: dict[str, dict[str, tuple[float, torch.Tensor]]] = {c: {} for c in CASES}
    for case in CASES:
        for name, (pd, ga) in SINGLE_LAYOUTS.items():
            results[case][name] = one_step(model_dir, case, alone, pd, ga)
    cached_1, eval_1 = precompute_and_eval(model_dir, alone)

    strategy_for(make_cfg(model_dir, "dpo", []), env).setup()  # the process group (gloo)
    for case in CASES:
        for name, (pd, ga) in DDP_LAYOUTS.items():
            results[case][name] = one_step(model_dir, case, env, pd, ga)
    cached_2, eval_2 = precompute_and_eval(model_dir, env)

    if env.rank == 0:
        out: dict[str, Any] = {"cases": {}, "failures": []}
        for case, by_layout in results.items():
            ref_loss, ref_grad = by_layout["1x4"]
            row = {}
            for name, (loss, grad) in by_layout.items():
                dl, dg = abs(loss - ref_loss), (grad - ref_grad).abs().max().item()
                row[name] = {"loss": loss, "loss_diff": dl, "grad_diff": dg, "grad_norm": grad.norm().item()}
                if dl > 1e-5 or dg > 1e-5:
                    out["failures"].append(f"{case} {name}: |dloss|={dl:.3g} max|dgrad|={dg:.3g}")
            if ref_grad.norm().item() < 1e-4:
                out["failures"].append(f"{case}: gradient is ~0, the comparison says nothing")
            out["cases"][case] = row
        dc = max(abs(a - b) for a, b in zip(cached_1, cached_2))
        out["precompute_max_diff"] = dc
        if len(cached_1) != len(cached_2) or dc > 1e-5:
            out["failures"].append(f"precomputed reference log-probs differ across layouts by {dc:.3g}")
        out["eval_1"], out["eval_2"] = eval_1, eval_2
        for k in eval_1:
            if abs(eval_1[k] - eval_2[k]) > 1e-5:
                out["failures"].append(f"eval {k}: {eval_1[k]} (1 rank) vs {eval_2[k]} (2 ranks)")
        with open(report, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
        print("FAILURES:" if out["failures"] else "ALL OK", *out["failures"], sep="\n", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0, barrier=True)
