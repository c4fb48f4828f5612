"""``alignkit validate``: the resolved config and the run plan, without training."""

from __future__ import annotations

import argparse
import dataclasses

import yaml

from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.algorithms.online import OnlineAlgorithm
from alignkit.config import load_config
from alignkit.config.loader import BatchPlan, resolve_batch, to_dict
from alignkit.config.schema import RunConfig
from alignkit.config.sections import registered_sections
from alignkit.distributed.env import read_env
from alignkit.distributed.strategy.base import pick_backend, pick_compute_dtype, pick_device
from alignkit.distributed.strategy.deepspeed_config import build_deepspeed_config
from alignkit.errors import UserError
from alignkit.models.loading import load_tokenizer
from alignkit.train.generator_loop import check_separate_config, trainer_processes
from alignkit.train.online_loop import check_groups, online_step_plan
from alignkit.train.run_plan import StepPlan, plan_run, plan_steps


def applying_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML with the sections that apply to this run: the core ones, the algorithm's own
    (:meth:`~alignkit.algorithms.base.Algorithm.own_sections`) and any other the config sets away from its
    defaults; the other algorithms' sections, all at their defaults, are named on one comment line (the saved
    ``config.yaml`` of a run keeps every section)."""
    own = set(ALGORITHMS.get(cfg.algorithm).own_sections())
    data = to_dict(cfg)
    left_out = [name for name, cls in registered_sections().items()
                if name not in own and cfg.section(cls) == cls()]
    for name in left_out:
        del data[name]
    note = f"# other algorithms' sections, at their defaults, not shown: {', '.join(left_out)}\n" if left_out else ""
    return yaml.safe_dump(data, sort_keys=False) + note


def cmd_validate(args: argparse.Namespace) -> int:
    print_plan(args.config, args.overrides, world_size=args.world_size)
    return 0


def print_plan(config: str, overrides: list[str], *, world_size: int | None = None) -> None:
    cfg = load_config(config, overrides)
    check_separate_config(cfg)
    env = read_env()
    if world_size is not None:
        env = dataclasses.replace(env, world_size=world_size, rank=0)
    # rollout.placement: separate: the batch is the trainers' (the generator processes train nothing)
    env = dataclasses.replace(env, world_size=trainer_processes(cfg, env.world_size))
    run = plan_run(cfg, env, workload_of(cfg))
    plan = run.batch
    device = pick_device(env)
    dtype = pick_compute_dtype(cfg.model.dtype, device)
    if run.strategy == "deepspeed":  # its JSON's own rules (train_batch_size = micro x accumulation x world, ...)
        build_deepspeed_config(run.distributed.deepspeed, per_device=plan.per_device, accumulation=plan.accumulation,
                               world_size=env.world_size, max_grad_norm=cfg.training.max_grad_norm, dtype=dtype)
    backend = pick_backend(cfg.distributed.backend, device) if env.world_size > 1 else "none"
    algo = ALGORITHMS.get(cfg.algorithm)(cfg, load_tokenizer(cfg.model))
    if cfg.data.streaming:  # a stream's length is unknown: training.max_steps steps (load_config requires it)
        n_train = plan.global_batch * (cfg.training.max_steps or 0)
    else:
        n_train = len(algo.data.build_dataset(cfg.data.train, "train"))
    if isinstance(algo, OnlineAlgorithm):
        check_groups(run, cfg)  # as the online loop does before it counts its steps
    steps = step_plan(algo, n_train, plan, cfg)
    print("# resolved config")
    print(applying_yaml(cfg).rstrip())
    print("# plan")
    rows = [
        ("algorithm", cfg.algorithm),
        ("strategy", f"{run.strategy} ({run.reason})"),
        ("processes", f"{env.world_size} (backend {backend})"),
        ("device", f"{device.type}, compute dtype {str(dtype).replace('torch.', '')}"),
        ("per-device batch", plan.per_device),
        ("gradient accumulation", plan.accumulation),
        ("global batch", plan.global_batch),
        (
            "effective batch",
            f"{plan.global_batch} (per_device={plan.per_device} x accumulation={plan.accumulation} "
            f"x {env.world_size} processes)",
        ),
        ("learning rate", f"{run.lr:.4g} (scaling {cfg.training.lr_scaling})"),
        ("training examples", f"{n_train} ({algo.data.skipped.get('train', 0)} skipped)"),
        ("micro-batches per epoch per process", steps.micro_per_epoch),
        ("optimizer steps per epoch", steps.per_epoch),
        ("optimizer steps", steps.total),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def batch_growth_note(cfg: RunConfig, processes: int) -> str | None:
    """``alignkit launch``'s line when the batch is given per device (no ``training.global_batch_size``): the
    effective batch is per_device x accumulation x processes, so N processes take N times fewer optimizer steps
    per epoch than one (with the learning rate of the one, unless ``training.lr_scaling``). None when the batch is
    global or one process runs."""
    processes = trainer_processes(cfg, processes)  # rollout.placement: separate: the trainers alone
    if cfg.training.global_batch_size is not None or processes == 1:
        return None
    one, many = resolve_batch(cfg, 1), resolve_batch(cfg, processes)
    line = (f"effective batch {many.global_batch} = per_device {many.per_device} x accumulation {many.accumulation} "
            f"x {processes} processes ({one.global_batch} on one process)")
    if not cfg.data.streaming:
        try:  # the epoch's length needs the tokenized data (validate's count); unreadable here = left out
            algo = ALGORITHMS.get(cfg.algorithm)(cfg, load_tokenizer(cfg.model))
            n_train = len(algo.data.build_dataset(cfg.data.train, "train"))
            per_epoch = [step_plan(algo, n_train, b, cfg).per_epoch for b in (many, one)]
            line += f": {per_epoch[0]} optimizer steps per epoch ({per_epoch[1]} on one)"
        except (UserError, OSError):
            pass
    return line + "; set training.global_batch_size to keep the batch whatever the processes"


def step_plan(algo: object, n_train: int, b: BatchPlan, cfg: RunConfig) -> StepPlan:
    """The steps of a run over ``n_train`` examples, counted as its loop trains them: an online algorithm's
    iterations draw global_batch / num_generations prompts each (validate and launch share this count)."""
    if isinstance(algo, OnlineAlgorithm):
        return online_step_plan(n_train, b, cfg)
    return plan_steps(n_train, b.per_device, b.accumulation, b.world_size, cfg.training)
