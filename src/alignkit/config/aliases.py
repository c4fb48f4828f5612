"""Config keys users already have: Hugging Face ``TrainingArguments`` names and the seed guides' keys.

Each alias is read on the raw YAML dict, before the typed dataclasses are built, and says once how
it was read (``config: per_device_train_batch_size=4 read as training.per_device_batch_size=4``).
HF users write these flat, at the top level or inside ``training:``; :data:`ALIASES` lists where
each is accepted. alignkit's own keys that moved are read the same way (``reward.pair`` ->
``reward_model.pair``). An alias and a native key (or two aliases) that give the same native key
different values are a one-line ConfigError naming both. ``alignkit migrate`` writes the result.

Decisions (README "Config keys from elsewhere"):
- top-level ``batch_size`` is per device (the seed guides' rm/dpo configs say "每个GPU的batch size"),
  ``training.batch_size`` is the GLOBAL batch split across processes (the multi-GPU guide says
  "总batch size，会自动除以GPU数量"): training.global_batch_size.
- ``save_strategy: epoch`` cannot be honoured at load time (steps per epoch depend on the data and
  the number of processes): a one-line error that says to use save_steps.
- ``dataloader_pin_memory`` / ``dataloader_drop_last`` / ``dataloader_prefetch_factor`` and
  ``logging_dir`` are accepted and ignored, with the reason.
- ``experiment_name`` becomes logging.run_name and, when output_dir is not given, output_dir=runs/NAME.
- ``bf16`` / ``fp16`` read as HF reads them: one true picks model.dtype; all given false is fp32.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from alignkit.config.alias_readers import (
    REWARD,
    TOP,
    TRAINING,
    WHY_DROP,
    WHY_PIN,
    WHY_PREFETCH,
    Alias,
    AliasContext,
    ignored,
    moved,
    read_dataloader,
    read_deepspeed,
    read_distributed_flag,
    read_experiment_name,
    read_lora,
    read_lr_scheduler,
    read_max_steps,
    read_minutes,
    read_mixed_precision,
    read_precision,
    read_report_to,
    read_resume,
    read_save_strategy,
    read_use_ddp,
    read_use_mixed_precision,
    rename,
    same,
    show,
)
from alignkit.errors import ConfigError

log = logging.getLogger("alignkit")

ALIASES: tuple[Alias, ...] = (
    # batch arithmetic
    Alias(("per_device_train_batch_size",), rename("training.per_device_batch_size")),
    Alias(("per_device_eval_batch_size",), rename("training.eval_batch_size")),
    Alias(("gradient_accumulation_steps",), rename("training.gradient_accumulation_steps"), (TOP,)),
    Alias(("accumulation_steps",), rename("training.gradient_accumulation_steps")),
    Alias(("batch_size",), rename("training.per_device_batch_size", why="per device"), (TOP,)),
    Alias(("batch_size",), rename("training.global_batch_size",
                                  why="the global batch per optimizer step, split across processes"), (TRAINING,)),
    Alias(("dataloader",), read_dataloader),
    # optimisation and schedule
    Alias(("num_train_epochs",), rename("training.epochs")),
    Alias(("max_steps",), read_max_steps, (TOP,)),
    Alias(("learning_rate",), rename("training.learning_rate"), (TOP,)),
    Alias(("lr_scheduler_type",), read_lr_scheduler),
    Alias(("warmup_ratio",), rename("training.warmup_ratio"), (TOP,)),
    Alias(("warmup_steps",), rename("training.warmup_steps"), (TOP,)),
    Alias(("weight_decay",), rename("training.weight_decay"), (TOP,)),
    Alias(("max_grad_norm",), rename("training.max_grad_norm"), (TOP,)),
    Alias(("adam_beta1",), rename("training.adam_beta1"), (TOP,)),
    Alias(("adam_beta2",), rename("training.adam_beta2"), (TOP,)),
    Alias(("adam_epsilon",), rename("training.adam_epsilon"), (TOP,)),
    Alias(("seed",), rename("training.seed"), (TOP,)),
    Alias(("eval_steps",), rename("training.eval_steps"), (TOP,)),
    # model and precision
    Alias(("model_name_or_path",), rename("model.name_or_path")),
    Alias(("gradient_checkpointing",), rename("model.gradient_checkpointing")),
    Alias(("bf16", "fp16"), read_precision),
    Alias(("mixed_precision",), read_mixed_precision),
    Alias(("use_mixed_precision",), read_use_mixed_precision),
    Alias(("fp16_opt_level",), ignored("apex opt levels are not used; model.dtype picks the precision")),
    Alias(("fp16_full_eval",), ignored("evaluation runs in model.dtype like training")),
    Alias(("use_lora", "lora"), read_lora),
    Alias(("max_length",), rename("data.max_length"), (TOP,)),
    Alias(("max_seq_length",), rename("data.max_length")),
    Alias(("dataloader_num_workers",), rename("data.num_workers")),
    Alias(("dataloader_pin_memory",), ignored(WHY_PIN)),
    Alias(("dataloader_drop_last",), ignored(WHY_DROP)),
    Alias(("dataloader_prefetch_factor",), ignored(WHY_PREFETCH)),
    # checkpoints, logging, output
    Alias(("output_dir",), rename("output_dir"), (TRAINING,)),
    Alias(("save_steps",), rename("checkpoint.save_steps")),
    Alias(("save_total_limit",), rename("checkpoint.save_total_limit")),
    Alias(("save_strategy",), read_save_strategy),
    Alias(("resume_from_checkpoint",), read_resume),
    Alias(("logging_steps",), rename("logging.logging_steps")),
    Alias(("report_to",), read_report_to),
    Alias(("run_name",), rename("logging.run_name")),
    Alias(("experiment_name",), read_experiment_name),
    Alias(("logging_dir",), ignored("TensorBoard files go to output_dir/tensorboard")),
    Alias(("push_to_hub",), rename("hub.push_to_hub")),
    Alias(("hub_model_id",), rename("hub.repo_id")),
    Alias(("hub_private_repo",), rename("hub.private")),
    # distributed
    Alias(("deepspeed",), read_deepspeed),
    Alias(("distributed_strategy",), rename("distributed.strategy")),
    Alias(("use_ddp",), read_use_ddp),
    Alias(("distributed",), read_distributed_flag, (TRAINING,)),
    Alias(("distributed_backend",), rename("distributed.backend")),
    Alias(("ddp_backend",), rename("distributed.backend")),
    Alias(("ddp_timeout",), rename("distributed.timeout_minutes", read_minutes, "seconds -> minutes")),
    Alias(("find_unused_parameters",), rename("distributed.ddp.find_unused_parameters")),
    Alias(("ddp_find_unused_parameters",), rename("distributed.ddp.find_unused_parameters")),
    Alias(("ddp_bucket_cap_mb",), rename("distributed.ddp.bucket_cap_mb")),
    Alias(("ddp_broadcast_buffers",), rename("distributed.ddp.broadcast_buffers")),
    # alignkit's own keys that moved: reward: scores online completions; training a reward / cost model
    # is reward_model: (read together, so a config that sets several says it in one note)
    Alias(("pair", "margin", "center_coeff", "reg_coeff"),
          moved("reward_model", "reward-model training keys moved to reward_model:; reward: is online scoring"),
          (REWARD,)),
)


# ---------------------------------------------------------------- applying the table


def _qualified(place: str, name: str) -> str:
    return f"{place}.{name}" if place else name


def _parent(raw: dict[str, Any], target: str, *, replace: bool = False) -> tuple[dict[str, Any], str]:
    """The dict that holds ``target``'s leaf (created on the way; ``replace``: over a non-mapping too,
    as an override does) and the leaf's name."""
    *parents, leaf = target.split(".")
    node = raw
    for part in parents:
        nxt = node.get(part)
        if nxt is None or (replace and not isinstance(nxt, dict)):
            nxt = node[part] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"{part}: expected a mapping of options, got {nxt!r}")
        node = nxt
    return node, leaf


def put(raw: dict[str, Any], target: str, value: Any, *, replace: bool = False) -> None:
    node, leaf = _parent(raw, target, replace=replace)
    node[leaf] = value




def assign(raw: dict[str, Any], target: str, value: Any, source: str, origins: dict[str, str]) -> None:
    """Set ``raw[target]``; a different value already there (native or from another alias) is an error."""
    node, leaf = _parent(raw, target)
    if leaf in node and not same(node[leaf], value):
        other = origins.get(target)
        given = f"{other} (read as {target}={show(node[leaf])})" if other else f"{target}={show(node[leaf])}"
        raise ConfigError(f"{source} (read as {target}={show(value)}) disagrees with {given}; give only {target}")
    node[leaf] = value
    origins.setdefault(target, source)


def apply_aliases(raw: dict[str, Any], *, given: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Move every alias of ``raw`` to its native key (in place); returns ``raw`` and one note per alias.

    ``given`` is the config file when ``raw`` holds only the command-line overrides: readers that
    fill a key only when it is unset (experiment_name -> output_dir) look there too.
    """
    raw, notes, _ = read_aliases(raw, given=given)
    return raw, notes


def read_aliases(
    raw: dict[str, Any], *, given: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[str], list[str]]:
    """:func:`apply_aliases`, also returning the native keys the aliases set."""
    ctx = AliasContext(raw, given)
    origins: dict[str, str] = {}
    notes: list[str] = []
    had = {place for alias in ALIASES for place in alias.places if place and raw.get(place)}
    for alias in ALIASES:
        found: dict[str, Any] = {}  # read together wherever written (bf16 at the top, fp16 under training:)
        written: list[str] = []
        for place in alias.places:
            section = raw if place == TOP else raw.get(place)
            if not isinstance(section, dict):
                continue
            for name in [n for n in alias.names if n in section]:
                value = section.pop(name)
                if name in found and not same(found[name], value):
                    raise ConfigError(f"{name}={show(found[name])} and {_qualified(place, name)}={show(value)} "
                                      "disagree; give one")
                found[name] = value
                written.append(f"{_qualified(place, name)}={show(value)}")
        if not found:
            continue
        source = ", ".join(written)
        targets, why = alias.read(found, ctx)
        for target, value in targets.items():
            assign(raw, target, value, source, origins)
        if targets:
            read_as = ", ".join(f"{t}={show(v)}" for t, v in targets.items())
            notes.append(f"config: {source} read as {read_as}" + (f" ({why})" if why else ""))
        else:
            notes.append(f"config: {source} accepted and ignored ({why})")
    for place in had:
        if raw.get(place) == {}:
            del raw[place]  # held only aliases
    return raw, notes, list(origins)


def _is_rank_zero() -> bool:
    """RANK as every launcher exports it, read here rather than through distributed/env.py: config/ is
    the bottom floor and imports nothing above it. A malformed RANK is named by read_env at start-up."""
    try:
        return int(os.environ.get("RANK") or 0) == 0
    except ValueError:
        return True


def emit_notes(notes: list[str]) -> None:
    """One line per note, from rank 0 only (every rank reads the config)."""
    if notes and _is_rank_zero():
        for line in notes:
            log.warning(line)
