"""``alignkit estimate``: per-GPU memory of a run config under each strategy, and which fit."""

from __future__ import annotations

import argparse
import dataclasses

from alignkit.algorithms import workload_of
from alignkit.cli.drawn_batches import drawn_batches
from alignkit.config import load_config
from alignkit.distributed.env import read_env
from alignkit.errors import ConfigError
from alignkit.planner.auto import describe, memory_inputs, probe_device_memory, strategy_for_plan
from alignkit.planner.model_dims import PRESETS
from alignkit.planner.plan import (
    GB,
    SHARDS_FROZEN,
    choose_strategy,
    estimate,
    fits,
    frozen_bytes,
    parse_memory,
)
from alignkit.planner.plan_report import format_table

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
    inputs = memory_inputs(cfg, workload_of(cfg), n_gpus=n, device="cuda", policy=PRESETS[preset] if preset else None,
                           frozen=frozen or [])
    drawn, why_not = drawn_batches(cfg, n) if preset is None else (None, "--preset: the run's data is not read")
    if drawn is not None:
        inputs = dataclasses.replace(inputs, drawn_tokens=drawn.tokens)
    memory = parse_memory(gpu_memory) if gpu_memory else None
    if memory is None:
        probed = probe_device_memory(env)
        memory = probed.bytes_per_rank if probed.device == "cuda" else None
    estimates = {s: estimate(inputs, s) for s in TABLE_STRATEGIES}
    worst = ({s: estimate(dataclasses.replace(inputs, drawn_tokens=None), s) for s in TABLE_STRATEGIES}
             if drawn is not None else None)
    lines = [f"# memory estimate: {config} (algorithm {cfg.algorithm}) on {n} GPU(s)"
             + (f" of {memory / GB:.1f} GB" if memory else ""),
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
    if memory is not None:
        ok = [s for s, e in estimates.items() if fits(e, memory, HEADROOM)]
        lines.append(f"fits in {memory / GB:.1f} GB per GPU ({HEADROOM * memory / GB:.1f} GB usable): "
                     + (", ".join(ok) if ok else "none (lower the per-device batch or max_length, enable "
                        "gradient checkpointing or LoRA, or add GPUs)"))
    else:
        lines.append("device memory unknown: pass --gpu-memory (e.g. 80GB) to see which strategies fit")
    pick, why = choose_strategy(inputs, memory, available=("ddp", "zero2", "zero3", "zero3_offload"),
                                headroom=HEADROOM)
    _, _, engine = strategy_for_plan(pick, "cuda", cfg.distributed)
    lines.append(f"distributed.strategy=auto on {n} GPU(s) would run {engine} ({why})")
    text = "\n".join(lines)
    print(text)
    return text

