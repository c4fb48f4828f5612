"""The pieces of the alias table (:mod:`alignkit.config.aliases`): how a value is shown and compared,
and the readers, each turning the keys users wrote into native dotted keys plus a one-line why."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Callable

from alignkit.errors import ConfigError

TOP, TRAINING, REWARD = "", "training", "reward"
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
class AliasContext:
    """What the readers may ask: is a native key already given (in this dict or, for overrides, the file)?"""

    raw: dict[str, Any]
    given: dict[str, Any] | None = None

    def is_set(self, dotted: str) -> bool:
        return any(lookup(d, dotted) is not None for d in (self.raw, self.given) if d is not None)


def lookup(raw: dict[str, Any], dotted: str) -> Any:
    """The value at ``dotted``, None when absent."""
    value = find(raw, dotted)
    return None if value is MISSING else value


MISSING = object()


def find(raw: dict[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` (None included), or :data:`MISSING`."""
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


Reader = Callable[[dict[str, Any], AliasContext], tuple[Targets, str]]


@dataclass(frozen=True)
class Alias:
    names: tuple[str, ...]  # keys read together (bf16 + fp16; use_lora + lora)
    read: Reader  # {name: value} -> (native targets, why)
    places: tuple[str, ...] = BOTH  # "" = top level, "training" = inside training:


def rename(target: str, convert: Callable[[Any], Any] | None = None, why: str = "") -> Reader:
    def read(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
        (value,) = found.values()
        return {target: convert(value) if convert else value}, why
    return read


def moved(section: str, why: str) -> Reader:
    """Keys that moved, under the same names, to another section (reward.pair -> reward_model.pair)."""
    def read(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
        return {f"{section}.{name}": value for name, value in found.items()}, why
    return read


def ignored(why: str) -> Reader:
    return lambda found, ctx: ({}, why)


# ---------------------------------------------------------------- the readers that need more than a rename


def read_max_steps(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`training.max_steps`; -1 (the HF Trainer's "unset") is ignored and training.epochs decides."""
    value = found["max_steps"]
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return {}, "-1 means unset in the HF Trainer; training.epochs decides"
    return {"training.max_steps": value}, ""


def read_precision(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`model.dtype`: the one given true (bf16 or fp16); all given false is fp32, as the HF Trainer runs; both true
    is an error."""
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


def read_mixed_precision(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`model.dtype`: bf16, fp16, or fp32 for no / none / false."""
    value = found["mixed_precision"]
    key = "no" if value is False or value is None else str(value).lower()
    if key not in _MIXED:
        raise ConfigError(f"mixed_precision={value!r}: expected one of bf16, fp16, no")
    return {"model.dtype": _MIXED[key]}, ""


def read_use_mixed_precision(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`model.dtype`: true = auto (bf16 where the GPU supports it, else fp16; fp32 on CPU), false = fp32."""
    on = found["use_mixed_precision"]
    if on:
        return {"model.dtype": "auto"}, "bf16 where the GPU supports it, else fp16; fp32 on CPU"
    return {"model.dtype": "fp32"}, ""


_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


def read_lr_scheduler(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`training.lr_scheduler`: linear, cosine, constant (constant_with_warmup = constant after training.warmup_*);
    others are an error."""
    value = found["lr_scheduler_type"]
    if value not in _SCHEDULERS:
        raise ConfigError(f"lr_scheduler_type={value!r} has no alignkit equivalent; use training.lr_scheduler: "
                          "constant, linear or cosine (each after training.warmup_steps / warmup_ratio)")
    return {"training.lr_scheduler": _SCHEDULERS[value]}, ""


HF_DEFAULT_SAVE_STEPS = 500


def read_save_strategy(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`checkpoint.save_steps`: steps = save_steps (or the HF default 500), no = no checkpoints during training;
    epoch is an error that says to use save_steps."""
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


def read_report_to(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`logging.report_to`: console and jsonl always, plus tensorboard / wandb as named (all = every installed one;
    none = only alignkit's own)."""
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


def read_resume(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`checkpoint.resume_from`: true = latest, false = null, a path as given."""
    value = found["resume_from_checkpoint"]
    if value is True:
        return {"checkpoint.resume_from": "latest"}, "the newest checkpoint in output_dir"
    if value is False or value is None:
        return {"checkpoint.resume_from": None}, ""
    return {"checkpoint.resume_from": value}, ""


def read_experiment_name(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`logging.run_name`, and `output_dir: runs/NAME` when no output_dir is given."""
    name = found["experiment_name"]
    if ctx.is_set("output_dir"):
        return {"logging.run_name": name}, ""
    return {"logging.run_name": name, "output_dir": f"runs/{name}"}, "no output_dir given"


_DS_FIELDS = ("zero_stage", "offload_optimizer", "offload_param", "config_path")


def read_deepspeed(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """a JSON path: `distributed.strategy: deepspeed` + `distributed.deepspeed.config_path`; a mapping of zero_stage
    / offload_optimizer / offload_param / config_path: `distributed.deepspeed.*`."""
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


def read_use_ddp(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`distributed.strategy`: true = ddp, false = single."""
    return {"distributed.strategy": "ddp" if found["use_ddp"] else "single"}, ""


def read_distributed_flag(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """false = `distributed.strategy: single`; true is accepted (the launcher decides)."""
    if not isinstance(found["distributed"], bool):
        raise ConfigError(f"training.distributed: expected true/false, got {found['distributed']!r}")
    if found["distributed"] is True:
        return {}, "the launcher decides: several processes train distributed with distributed.strategy"
    return {"distributed.strategy": "single"}, ""


_LORA_KEYS = {"r": "r", "alpha": "alpha", "lora_alpha": "alpha", "dropout": "dropout", "lora_dropout": "dropout",
              "target_modules": "target_modules"}


def read_lora(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """`model.lora` (r, alpha / lora_alpha, dropout / lora_dropout, target_modules; task_type and bias: none
    skipped); use_lora: false = full fine-tuning."""
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


def read_dataloader(found: dict[str, Any], ctx: AliasContext) -> tuple[Targets, str]:
    """batch_size -> `training.per_device_batch_size`, num_workers -> `data.num_workers`; pin_memory, drop_last,
    prefetch_factor, persistent_workers ignored."""
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


def read_minutes(seconds: Any) -> Any:
    n = _number(seconds)
    return n / 60 if n is not None else seconds
