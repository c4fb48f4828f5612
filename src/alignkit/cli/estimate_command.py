"""``alignkit estimate``: per-GPU memory of a run config under each strategy, and which fit."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from alignkit.algorithms import ALGORITHMS, workload_of
from alignkit.algorithms.token_rollout import run_engine
from alignkit.cli.drawn_batches import drawn_batches
from alignkit.config import load_config
from alignkit.config.loader import resolve_batch
from alignkit.config.schema import RunConfig
from alignkit.distributed.env import read_env
from alignkit.errors import ConfigError
from alignkit.models.roles import ModelSpec, Workload
from alignkit.planner.auto import (
    _dims_of as dims_of,
)
from alignkit.planner.auto import (
    compute_dtype,
    describe,
    memory_inputs,
    probe_device_memory,
    strategy_for_plan,
)
from alignkit.planner.generators import GeneratorInputs, generator_estimate
from alignkit.planner.model_dims import PRESETS
from alignkit.planner.plan import (
    GB,
    SHARDS_FROZEN,
    MemoryInputs,
    choose_strategy,
    estimate,
    fits,
    frozen_bytes,
    parse_memory,
)
from alignkit.planner.plan_report import format_table
from alignkit.rollout.config import RolloutConfig
from alignkit.train.generator_loop import generator_scored_roles, separate_split, separate_workload

TABLE_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp")
HEADROOM = 0.9


def cmd_estimate(args: argparse.Namespace) -> int:
    estimate_command(args.config, args.overrides, gpus=args.gpus, gpu_memory=args.gpu_memory, preset=args.preset,
                     frozen=args.frozen)
    return 0


def estimate_command(config: str, overrides: list[str], *, gpus: int | None = None, gpu_memory: str | None = None,
                     preset: str | None = None, frozen: list[str] | None = None) -> str:
    """Print (and return) the table for ``config`` on ``gpus`` GPUs of ``gpu_memory`` each.

    ``preset`` replaces the policy read from ``model.name_or_path`` (no local model needed);
    ``frozen`` adds reward/cost models (presets or local dirs). Without ``gpu_memory`` the local GPU's
    memory is used when there is one.
    """
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"--preset: unknown {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = load_config(config, overrides)
    if preset is not None:  # the preset is the policy: model.name_or_path is not read (it need not exist here,
        # and an absent local path would be looked up as a hub id, with retries, when offline)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=""))
    env = read_env()
    n = gpus or env.world_size
    if n < 1:
        raise ConfigError(f"--gpus must be >= 1, got {n}")
    split, trainer_work, scorers = placed_workload(cfg, n)
    n_train = split[0] if split else n
    inputs = memory_inputs(cfg, trainer_work, n_gpus=n_train, device="cuda",
                           policy=PRESETS[preset] if preset else None, frozen=frozen or [])
    drawn, why_not = drawn_batches(cfg, n_train) if preset is None else (None, "--preset: the run's data is not read")
    inputs = dataclasses.replace(inputs, drawn_tokens=drawn.tokens) if drawn is not None else inputs
    memory = parse_memory(gpu_memory) if gpu_memory else None
    if memory is None:
        probed = probe_device_memory(env)
        memory = probed.bytes_per_rank if probed.device == "cuda" else None
    estimates = {s: estimate(inputs, s) for s in TABLE_STRATEGIES}
    worst = ({s: estimate(dataclasses.replace(inputs, drawn_tokens=None), s) for s in TABLE_STRATEGIES}
             if drawn is not None else None)
    lines = [f"# memory estimate: {config} (algorithm {cfg.algorithm}) on {n} GPU(s)"
             + (f" of {memory / GB:.1f} GB" if memory else "")
             + (f": rollout.placement separate, {split[0]} trainer + {split[1]} generator processes; the table is "
                "a trainer's (no rollout engine's share)" if split else ""),
             f"# {describe(inputs)}",
             "# activations sized from " + (
                 f"the largest micro-batch this run draws: {drawn.tokens} tokens ({drawn.micro_batches} micro-batches "
                 f"of {drawn.examples} examples replayed, {'packed' if drawn.packed else 'padded'}); worst case "
                 f"{inputs.worst_case_tokens} tokens beside it" if drawn is not None else
                 f"the worst case, {inputs.worst_case_tokens} tokens per micro-batch ({why_not})"),
             format_table(inputs, estimates, memory, HEADROOM, worst_case=worst)]
    setting = cfg.distributed.shard_frozen
    if inputs.shard_frozen and any(frozen_bytes(e) for e in estimates.values()):
        lines.append(f"frozen models counted sharded under {', '.join(s for s in estimates if s in SHARDS_FROZEN)}: "
                     f"distributed.shard_frozen={str(setting).lower()}"
                     + (" shards them only where replicated copies would not fit" if setting == "auto" else ""))
    lines.append(fit_line(estimates, memory))
    pick, why = choose_strategy(inputs, memory, available=("ddp", "zero2", "zero3", "zero3_offload"),
                                headroom=HEADROOM)
    _, _, engine = strategy_for_plan(pick, "cuda", cfg.distributed)
    lines.append(f"distributed.strategy=auto on {n_train} trainer GPU(s) would run {engine} ({why})" if split else
                 f"distributed.strategy=auto on {n} GPU(s) would run {engine} ({why})")
    if split:
        lines += generator_lines(cfg, scorers, inputs, split, memory)
    text = "\n".join(lines)
    print(text)
    return text


def fit_line(estimates: dict[str, Any], memory: int | None) -> str:
    """Which strategies fit in ``memory`` per GPU (or how to learn it)."""
    if memory is None:
        return "device memory unknown: pass --gpu-memory (e.g. 80GB) to see which strategies fit"
    ok = [s for s, e in estimates.items() if fits(e, memory, HEADROOM)]
    return (f"fits in {memory / GB:.1f} GB per GPU ({HEADROOM * memory / GB:.1f} GB usable): "
            + (", ".join(ok) if ok else "none (lower the per-device batch or max_length, enable "
               "gradient checkpointing or LoRA, or add GPUs)"))


def placed_workload(cfg: RunConfig, n: int) -> tuple[tuple[int, int] | None, Workload, list[ModelSpec]]:
    """(trainer and generator processes of ``n`` under ``rollout.placement: separate``, else None; the trainers'
    workload; the reward model roles the generators load instead)."""
    split = separate_split(cfg, n)
    workload = workload_of(cfg)
    algo_cls = ALGORITHMS.get(cfg.algorithm)
    if split is None or algo_cls.split_rollout(cfg) != "completions":  # an algorithm's own items score elsewhere
        return split, workload, []
    algo = algo_cls(cfg, None)  # its signals name the roles; the default rollout's algorithms need no tokenizer here
    roles = generator_scored_roles(algo)
    return split, separate_workload(algo, workload, False), [s for s in workload.frozen if s.role in roles]


def generator_lines(cfg: RunConfig, scorers: list[ModelSpec], inputs: MemoryInputs, split: tuple[int, int],
                    memory: int | None) -> list[str]:
    """The generator processes' rows (``planner/generators.py``): one generator's per-GPU memory (``scorers``: the
    reward model roles it loads), beside the trainers' table."""
    r = cfg.section(RolloutConfig)
    trainers, generators = split
    per_generator = resolve_batch(cfg, trainers).global_batch // generators
    trust = cfg.model.trust_remote_code
    dtype = compute_dtype(cfg, "cuda")
    _, settings = run_engine(cfg)
    gen = GeneratorInputs(policy=inputs.policy, policy_dtype=dtype if inputs.lora_r else "fp32", compute_dtype=dtype,
                          engine=r.engine, batch=min(r.generation_batch_size, per_generator),
                          seq_len=cfg.data.max_length + r.max_new_tokens, per_device=inputs.per_device_batch,
                          logits_chunk_rows=inputs.logits_chunk_rows,
                          frozen_models=[dims_of(s, trust) for s in scorers],
                          engine_fraction=getattr(settings, "gpu_memory_utilization", 0.0))
    rows = generator_estimate(gen, memory)
    out = [f"generator processes: {generators}, one GPU each (engine {r.engine}, {gen.batch} sequences per generate "
           f"call of <= {gen.seq_len} tokens; no gradients or optimizer states"
           + (f"; reward models {', '.join(s.role for s in scorers)}" if scorers else "") + "):"]
    out += [f"  {label:<24}{value / GB:>10.2f}" for label, value in rows.items() if value or label == "total"]
    if r.engine == "vllm" and memory is None:
        out.append("  (the vLLM engine's share, vllm.gpu_memory_utilization x device memory, is not counted: pass "
                   "--gpu-memory)")
    if memory is not None:
        out.append(f"  fits (<= {HEADROOM * memory / GB:.1f}): {'yes' if fits_bytes(rows['total'], memory) else 'no'}")
    return out


def fits_bytes(total: int, memory: int) -> bool:
    """Whether ``total`` bytes fit in ``memory`` with the estimate's headroom."""
    return total <= HEADROOM * memory
