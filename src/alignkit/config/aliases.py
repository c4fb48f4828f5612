"""Config keys users already have: Hugging Face ``TrainingArguments`` names and the seed guides' keys.

Each alias is read on the raw YAML dict, before the typed dataclasses are built, and says once how
it was read (``config: per_device_train_batch_size=4 read as training.per_device_batch_size=4``).
HF users write these flat, at the top level or inside ``training:``; :data:`ALIASES` lists where
each is accepted. An alias and a native key (or two aliases) that give the same native key
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

import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

from alignkit.errors import ConfigError

log = logging.getLogger("alignkit")

TOP, TRAINING = "", "training"
BOTH = (TOP, TRAINING)
Targets = dict[str, Any]  # native dotted key -> value ({} = accepted and ignored)


def show(v: Any) -> str:
    """A value as YAML would read it back: true, null, [a, b], {r: 16}."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(show(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {show(x)}" for k, x in v.items()) + "}"
    return str(v)


def same(a: Any, b: Any) -> bool:
    """Equal as config values: numbers (YAML may hold ``3e-5`` as a string) compare as floats."""
    fa, fb = _number(a), _number(b)
    if fa is not None and fb is not None:
        return math.isclose(fa, fb, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


@dataclass
class Context:
    """What the readers may ask: is a native key already given (in this dict or, for overrides, the file)?"""

    raw: dict[str, Any]
    given: dict[str, Any] | None = None

    def is_set(self, dotted: str) -> bool:
        return any(lookup(d, dotted) is not None for d in (self.raw, self.given) if d is not None)


def lookup(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


Reader = Callable[[dict[str, Any], Context], tuple[Targets, str]]


@dataclass(frozen=True)
class Alias:
    names: tuple[str, ...]  # keys read together (bf16 + fp16; use_lora + lora)
    read: Reader  # {name: value} -> (native targets, why)
    places: tuple[str, ...] = BOTH  # "" = top level, "training" = inside training:


def rename(target: str, convert: Callable[[Any], Any] | None = None, why: str = "") -> Reader:
    def read(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
        (value,) = found.values()
        return {target: convert(value) if convert else value}, why
    return read


def ignored(why: str) -> Reader:
    return lambda found, ctx: ({}, why)


# ---------------------------------------------------------------- the readers that need more than a rename


def _max_steps(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    value = found["max_steps"]
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return {}, "-1 means unset in the HF Trainer; training.epochs decides"
    return {"training.max_steps": value}, ""


def _precision(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    for name, v in found.items():
        if not isinstance(v, bool):
            raise ConfigError(f"{name}: expected true/false, got {v!r}")
    on = [n for n, v in found.items() if v]
    if len(on) > 1:
        raise ConfigError("bf16=true and fp16=true: pick one (model.dtype: bf16 or fp16)")
    if on:
        return {"model.dtype": on[0]}, ""
    return {"model.dtype": "fp32"}, "no half precision, as the HF Trainer runs; model.dtype auto is bf16/fp16 on GPUs"


_MIXED = {"bf16": "bf16", "fp16": "fp16", "no": "fp32", "none": "fp32", "fp32": "fp32", "auto": "auto"}


def _mixed_precision(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    value = found["mixed_precision"]
    key = "no" if value is False or value is None else str(value).lower()
    if key not in _MIXED:
        raise ConfigError(f"mixed_precision={value!r}: expected one of bf16, fp16, no")
    return {"model.dtype": _MIXED[key]}, ""


def _use_mixed_precision(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    on = found["use_mixed_precision"]
    if on:
        return {"model.dtype": "auto"}, "bf16 where the GPU supports it, else fp16; fp32 on CPU"
    return {"model.dtype": "fp32"}, ""


_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


def _lr_scheduler(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    value = found["lr_scheduler_type"]
    if value not in _SCHEDULERS:
        raise ConfigError(f"lr_scheduler_type={value!r} has no alignkit equivalent; use training.lr_scheduler: "
                          "constant, linear or cosine (each after training.warmup_steps / warmup_ratio)")
    return {"training.lr_scheduler": _SCHEDULERS[value]}, ""


HF_DEFAULT_SAVE_STEPS = 500


def _save_strategy(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    value = str(found["save_strategy"]).lower()
    if value == "no":
        return {"checkpoint.save_steps": None}, "no checkpoints during training; the final model is still saved"
    if value == "steps":
        if ctx.is_set("checkpoint.save_steps"):
            return {}, "saves every checkpoint.save_steps"
        return ({"checkpoint.save_steps": HF_DEFAULT_SAVE_STEPS},
                f"no save_steps given: the HF default {HF_DEFAULT_SAVE_STEPS}")
    if value == "epoch":
        raise ConfigError("save_strategy='epoch' cannot be honoured: alignkit saves every checkpoint.save_steps "
                          "optimizer steps; set save_steps to the steps per epoch that `alignkit validate` prints")
    raise ConfigError(f"save_strategy={found['save_strategy']!r}: expected steps or no (epoch: use save_steps)")


_SINKS = ("console", "jsonl", "tensorboard", "wandb")


def _report_to(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    value = found["report_to"]
    names = [value] if isinstance(value, str) else list(value or [])
    if names in (["none"], []):
        return {"logging.report_to": ["console", "jsonl"]}, "alignkit's own console and metrics.jsonl stay on"
    if names == ["all"]:
        names = [n for n in ("tensorboard", "wandb") if importlib.util.find_spec(n)]  # HF: every installed one
    bad = [n for n in names if n not in _SINKS]
    if bad:
        raise ConfigError(f"report_to: {bad[0]!r} is not supported; alignkit writes to {', '.join(_SINKS)}")
    sinks = ["console", "jsonl"] + [n for n in names if n not in ("console", "jsonl")]
    return {"logging.report_to": sinks}, "console and metrics.jsonl are alignkit's own logs"


def _resume(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    value = found["resume_from_checkpoint"]
    if value is True:
        return {"checkpoint.resume_from": "latest"}, "the newest checkpoint in output_dir"
    if value is False or value is None:
        return {"checkpoint.resume_from": None}, ""
    return {"checkpoint.resume_from": value}, ""


def _experiment_name(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    name = found["experiment_name"]
    if ctx.is_set("output_dir"):
        return {"logging.run_name": name}, ""
    return {"logging.run_name": name, "output_dir": f"runs/{name}"}, "no output_dir given"


_DS_FIELDS = ("zero_stage", "offload_optimizer", "offload_param", "config_path")


def _deepspeed(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    value = found["deepspeed"]
    if isinstance(value, str):
        return {"distributed.strategy": "deepspeed", "distributed.deepspeed.config_path": value}, ""
    if isinstance(value, dict):
        unknown = [k for k in value if k not in _DS_FIELDS]
        if unknown:
            raise ConfigError(f"deepspeed.{unknown[0]}: an inline DeepSpeed config is not read; save it as a JSON "
                              "file and give deepspeed: PATH (or distributed.deepspeed.config_path)")
        return {f"distributed.deepspeed.{k}": v for k, v in value.items()}, ""
    raise ConfigError(f"deepspeed: expected a JSON path, got {value!r}")


def _use_ddp(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    return {"distributed.strategy": "ddp" if found["use_ddp"] else "single"}, ""


def _distributed_flag(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    if not isinstance(found["distributed"], bool):
        raise ConfigError(f"training.distributed: expected true/false, got {found['distributed']!r}")
    if found["distributed"] is True:
        return {}, "the launcher decides: several processes train distributed with distributed.strategy"
    return {"distributed.strategy": "single"}, ""


_LORA_KEYS = {"r": "r", "alpha": "alpha", "lora_alpha": "alpha", "dropout": "dropout", "lora_dropout": "dropout",
              "target_modules": "target_modules"}


def _lora(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    use, section = found.get("use_lora"), found.get("lora")
    if use is False or (use is None and section is None):  # `use_lora: false`, or a bare `lora:`
        return {"model.lora": None}, "full fine-tuning" + ("; the lora section is not used" if section else "")
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"lora: expected a mapping like {{r: 16, alpha: 32, dropout: 0.1}}, got {section!r}")
    out: dict[str, Any] = {}
    for k, v in section.items():
        if k == "task_type" or (k == "bias" and v == "none"):
            continue  # alignkit picks the task per algorithm; no bias training is its behaviour
        if k not in _LORA_KEYS:
            raise ConfigError(f"lora.{k}: unknown; use r, alpha, dropout, target_modules")
        out[_LORA_KEYS[k]] = v
    return {"model.lora": out}, ""


_DATALOADER = {"batch_size": "training.per_device_batch_size", "num_workers": "data.num_workers"}


def _dataloader(found: dict[str, Any], ctx: Context) -> tuple[Targets, str]:
    section = found["dataloader"]
    if not isinstance(section, dict):
        raise ConfigError(f"dataloader: expected a mapping like {{batch_size: 8, num_workers: 4}}, got {section!r}")
    out: Targets = {}
    for k, v in section.items():
        if k in _DATALOADER:
            out[_DATALOADER[k]] = v
        elif k not in _DATALOADER_IGNORED:
            raise ConfigError(f"dataloader.{k}: unknown; use batch_size (per device) and num_workers")
    skipped = [f"{k} ignored: {_DATALOADER_IGNORED[k]}" for k in section if k in _DATALOADER_IGNORED]
    return out, "; ".join(["batch_size is per device", *skipped] if "batch_size" in section else skipped)


WHY_PIN = "alignkit's DataLoader does not pin host memory; batches move to the device per micro-batch"
WHY_DROP = "alignkit uses every example; the epoch's last, shorter optimizer step is weighted exactly"
WHY_PREFETCH = "workers prefetch with PyTorch's default"
_DATALOADER_IGNORED = {"pin_memory": WHY_PIN, "drop_last": WHY_DROP, "prefetch_factor": WHY_PREFETCH,
                       "persistent_workers": "workers start once per epoch"}


def _minutes(seconds: Any) -> Any:
    n = _number(seconds)
    return n / 60 if n is not None else seconds


ALIASES: tuple[Alias, ...] = (
    # batch arithmetic
    Alias(("per_device_train_batch_size",), rename("training.per_device_batch_size")),
    Alias(("per_device_eval_batch_size",), rename("training.eval_batch_size")),
    Alias(("gradient_accumulation_steps",), rename("training.gradient_accumulation_steps"), (TOP,)),
    Alias(("accumulation_steps",), rename("training.gradient_accumulation_steps")),
    Alias(("batch_size",), rename("training.per_device_batch_size", why="per device"), (TOP,)),
    Alias(("batch_size",), rename("training.global_batch_size",
                                  why="the global batch per optimizer step, split across processes"), (TRAINING,)),
    Alias(("dataloader",), _dataloader),
    # optimisation and schedule
    Alias(("num_train_epochs",), rename("training.epochs")),
    Alias(("max_steps",), _max_steps, (TOP,)),
    Alias(("learning_rate",), rename("training.learning_rate"), (TOP,)),
    Alias(("lr_scheduler_type",), _lr_scheduler),
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
    Alias(("bf16", "fp16"), _precision),
    Alias(("mixed_precision",), _mixed_precision),
    Alias(("use_mixed_precision",), _use_mixed_precision),
    Alias(("fp16_opt_level",), ignored("apex opt levels are not used; model.dtype picks the precision")),
    Alias(("fp16_full_eval",), ignored("evaluation runs in model.dtype like training")),
    Alias(("use_lora", "lora"), _lora),
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
    Alias(("save_strategy",), _save_strategy),
    Alias(("resume_from_checkpoint",), _resume),
    Alias(("logging_steps",), rename("logging.logging_steps")),
    Alias(("report_to",), _report_to),
    Alias(("run_name",), rename("logging.run_name")),
    Alias(("experiment_name",), _experiment_name),
    Alias(("logging_dir",), ignored("TensorBoard files go to output_dir/tensorboard")),
    # distributed
    Alias(("deepspeed",), _deepspeed),
    Alias(("distributed_strategy",), rename("distributed.strategy")),
    Alias(("use_ddp",), _use_ddp),
    Alias(("distributed",), _distributed_flag, (TRAINING,)),
    Alias(("distributed_backend",), rename("distributed.backend")),
    Alias(("ddp_backend",), rename("distributed.backend")),
    Alias(("ddp_timeout",), rename("distributed.timeout_minutes", _minutes, "seconds -> minutes")),
    Alias(("find_unused_parameters",), rename("distributed.ddp.find_unused_parameters")),
    Alias(("ddp_find_unused_parameters",), rename("distributed.ddp.find_unused_parameters")),
    Alias(("ddp_bucket_cap_mb",), rename("distributed.ddp.bucket_cap_mb")),
    Alias(("ddp_broadcast_buffers",), rename("distributed.ddp.broadcast_buffers")),
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


MISSING = object()


def find(raw: dict[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` (None included), or :data:`MISSING`."""
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


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
    ctx = Context(raw, given)
    origins: dict[str, str] = {}
    notes: list[str] = []
    had_training = bool(raw.get(TRAINING))
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
    if had_training and raw.get(TRAINING) == {}:
        del raw[TRAINING]  # held only aliases
    return raw, notes, list(origins)


def emit_notes(notes: list[str]) -> None:
    """One line per note, from rank 0 only (every rank reads the config)."""
    from alignkit.distributed.env import read_env

    if notes and read_env().is_main:
        for line in notes:
            log.warning(line)
