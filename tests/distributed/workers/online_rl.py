"""Online RL across ranks, through the real runner and loop (and the statistics helpers alone).

``stats``: groups split across ranks -> advantages from the gathered rewards equal the one-process
computation on the same samples; ``placement: main`` gives each rank the scores of its own samples;
global whitening statistics are the same on every rank and leave out an unscorable sample (rank 1's
last), which keeps advantage 0. Writes ``stats_RANK.json``.

``resume ALGO``: a straight run (8 iterations, checkpoint at 4) and a run resumed from a copy of
checkpoint-4; every rank writes what it saw (its lambda, the iteration statistics) to
``ranks_RUN_RANK.json``; rank 0 compares losses and final weights in ``report.json``.

``cases CASES_JSON`` ({name: [ALGO, STRATEGY, [OVERRIDE ...]]}): ``resume`` for each case, one after another in
the same launch (a launch's start-up costs more than a case), each in OUT_DIR/name; ``stats+cases CASES_JSON``:
``stats`` into OUT_DIR/stats first, then the cases.

Usage: ``[torchrun --nproc_per_node=2] online_rl.py MODEL_DIR OUT_DIR MODE [ALGO] [STRATEGY] [OVERRIDE ...]``
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

from alignkit.config import load_config
from alignkit.distributed import comm
from alignkit.distributed.comm import exit_process
from alignkit.train.runner import run_train


def stats_mode(out: Path) -> None:
    import torch.distributed as dist

    from alignkit.algorithms.ppo import token_moments, whiten_tokens
    from alignkit.algorithms.reward import RewardFunctionConfig
    from alignkit.config.schema import DistributedConfig
    from alignkit.distributed.env import read_env
    from alignkit.distributed.strategy import build_strategy
    from alignkit.rewards.signals import ScoreInputs, Signal, gather_scores
    from alignkit.rollout.advantages import ADVANTAGES

    build_strategy("ddp", DistributedConfig(), read_env(), "fp32").setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    # groups of 2: (0,1) (2,3) (4,5); rank 0 holds 0..2, so group (2,3) spans the ranks; 4 is unscorable
    whole = torch.tensor([1.0, 0.0, 0.5, 2.0, math.nan, 3.0])
    n_local = whole.numel() // world
    mine = slice(rank * n_local, (rank + 1) * n_local)
    gathered = gather_scores({"total": whole[mine].tolist()})["total"]
    report = {"gathered_equal": bool(torch.equal(torch.nan_to_num(gathered, 7.0), torch.nan_to_num(whole.double(), 7.0)))}
    for name in ("grpo", "rloo", "dr_grpo"):
        ref = ADVANTAGES.get(name)(whole, 2)
        report[name] = (ADVANTAGES.get(name)(gathered, 2)[mine] - ref[mine]).abs().max().item()
    completions = [" ".join([f"r{rank}"] * (i + 1 + 3 * rank)) for i in range(n_local)]  # 1..3 / 4..6 words
    fields = [{"answer": "r1 r1 r1 r1"} for i in range(n_local)]  # rank 1's first completion matches
    inputs = ScoreInputs(["p"] * n_local, completions, [1] * n_local, fields, [])
    local = Signal("reward", [RewardFunctionConfig("length"), RewardFunctionConfig("exact_match", 2.0)]).score(None, inputs, None)
    main = Signal("reward", [RewardFunctionConfig("length"), RewardFunctionConfig("exact_match", 2.0)],
                  placement="main").score(None, inputs, None)
    report["placement_main_equal_local"] = main == local
    report["local_total"] = local["total"]
    samples = [{"adv": [float(rank + i), float(2 * rank - i)], "loss_mask": [1.0, 1.0]} for i in range(n_local)]
    if rank == 1:  # an unscorable sample (PPO gives it advantage 0, loss_mask 0): out of the statistics
        samples[-1] = {"adv": [0.0, 0.0], "loss_mask": [0.0, 0.0]}
    mean, var = token_moments(samples, ["adv"])["adv"]
    whiten_tokens(samples, "adv", mean, var)
    report["whiten_stats"] = [mean, var]
    report["whitened"] = [s["adv"] for s in samples if s["loss_mask"][0]]
    report["unscorable"] = [s["adv"] for s in samples if not s["loss_mask"][0]]
    (out / f"stats_{rank}.json").write_text(json.dumps(report))


def config(model_dir: str, prompts: Path, out: Path, algo: str, strategy: str, world: int, *extra: str):
    return load_config(None, [
        f"algorithm={algo}", f"model.name_or_path={model_dir}", f"output_dir={out}", f"data.train={prompts}",
        "data.max_length=48", "rollout.num_generations=4", "rollout.max_new_tokens=6", "rollout.update_epochs=2",
        # 8 completions per step = 2 prompts x 4: with 2 ranks every group spans both (4 local completions)
        f"training.per_device_batch_size={4 // world}", "training.gradient_accumulation_steps=2",
        "training.learning_rate=1e-3", "training.max_steps=8", "training.seed=0", "checkpoint.save_steps=4",
        "logging.report_to=[jsonl]", "logging.logging_steps=2", "logging.plot=false", f"distributed.strategy={strategy}",
        "reward.functions=[{name: length, weight: 0.1}, {name: exact_match, weight: 1.0}]",
        "ppo_lag.cost_functions=[{name: length, weight: 1.0}]", "ppo_lag.threshold=2.0", "ppo_lag.lambda_lr=0.5",
        "ppo_lag.window=2", *extra,
    ])


def record_ranks(out: Path, run: str) -> None:
    """Patch the loop so every rank writes its iteration statistics and lambda (identical on every rank?)."""
    from alignkit.train import online_loop

    original = getattr(online_loop.OnlineTrainer, "_unpatched_rollout", online_loop.OnlineTrainer._rollout)
    online_loop.OnlineTrainer._unpatched_rollout = original
    seen: list[dict] = []

    def spy(self, state):
        experience, took = original(self, state)
        row = {k: v for k, v in experience.stats.means().items() if not k.endswith("_s") and "per_s" not in k}
        row["lambda"] = getattr(self.algo, "lam", None)
        seen.append(row)
        (out / f"ranks_{run}_{comm.rank()}.json").write_text(json.dumps(seen))
        return experience, took

    online_loop.OnlineTrainer._rollout = spy


def resume_mode(model_dir: str, out: Path, algo: str, strategy: str, *extra: str) -> None:
    from safetensors.torch import load_file

    from alignkit.data.synth import make_prompt_rows, write_rows

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    prompts = out / "prompts.jsonl"
    if rank0:
        write_rows(make_prompt_rows(40, seed=0), prompts)
    comm_barrier()
    record_ranks(out, "straight")
    straight = run_train(config(model_dir, prompts, out / "straight", algo, strategy, world, *extra))
    if rank0:
        shutil.copytree(out / "straight" / "checkpoint-4", out / "resumed" / "checkpoint-4")
        (out / "resumed" / "latest").write_text("checkpoint-4")
    comm_barrier()
    record_ranks(out, "resumed")
    resumed = run_train(config(model_dir, prompts, out / "resumed", algo, strategy, world, *extra,
                               "checkpoint.resume_from=latest"))
    if rank0:
        report = {"straight": straight.losses, "resumed": resumed.losses, "weights": {}}
        for folder in sorted(p.name for p in (out / "straight").iterdir() if p.name.startswith("final")):
            a = load_file(str(out / "straight" / folder / "model.safetensors"))
            b = load_file(str(out / "resumed" / folder / "model.safetensors"))
            report["weights"][folder] = max((a[k] - b[k]).abs().max().item() for k in a)
        rows = [json.loads(x) for x in (out / "straight" / "metrics.jsonl").read_text().splitlines()]
        report["logged"] = rows
        (out / "report.json").write_text(json.dumps(report, indent=1))


def comm_barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    model_dir, out_dir, mode = sys.argv[1:4]
    if mode == "stats":
        stats_mode(Path(out_dir))
    elif mode in ("cases", "stats+cases"):  # stats+cases: stats_mode into OUT_DIR/stats first, in the same launch
        if mode == "stats+cases":
            (Path(out_dir) / "stats").mkdir(parents=True, exist_ok=True)
            stats_mode(Path(out_dir) / "stats")
            comm_barrier()
        for name, (algo, strategy, extra) in json.loads(sys.argv[4]).items():
            (Path(out_dir) / name).mkdir(parents=True, exist_ok=True)
            comm_barrier()
            resume_mode(model_dir, Path(out_dir) / name, algo, strategy, *extra)
            comm_barrier()
    else:
        resume_mode(model_dir, Path(out_dir), sys.argv[4], sys.argv[5] if len(sys.argv) > 5 else "ddp", *sys.argv[6:])
    exit_process(0, barrier=True)
