"""The DeepSpeed JSON config, built from alignkit's own settings so the two never disagree.

A user file (``distributed.deepspeed.config_path``) may say ``"auto"`` for the batch sizes,
gradient clipping, precision and ZeRO bucket sizes; those are filled from ``training.*``,
``model.dtype`` and the model's hidden size. A concrete value that disagrees with alignkit's is a
one-line ConfigError naming the key. Its ``optimizer`` and ``scheduler`` sections (and concrete
batch, clipping and precision values) were read into training.* when the config was loaded
(config/deepspeed_json.py); the sections are dropped here. No DeepSpeed import: plain dict work.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from alignkit.config.deepspeed_json import read_deepspeed_json
from alignkit.config.schema import DeepSpeedConfig
from alignkit.errors import ConfigError

AUTO = "auto"
WHERE = "distributed.deepspeed"


def _fill(section: dict[str, Any], key: str, value: Any, *, dotted: str, source: str, origin: str) -> None:
    """Set ``section[key]`` to ``value`` when missing or "auto"; a different value is an error."""
    have = section.get(key, AUTO)
    if have == AUTO:
        section[key] = value
        return
    if not _same(have, value):
        raise ConfigError(
            f"{origin}: {dotted}={have!r} disagrees with {source}={value!r}; set it to \"auto\" or change {source}"
        )


def _same(a: Any, b: Any) -> bool:
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return math.isclose(a, b) if numbers else a == b


def _offload(zero: dict[str, Any], key: str, want: bool, dotted: str, origin: str) -> None:
    """Turn on CPU offload of ``key`` when asked; a file that already offloads elsewhere is an error."""
    if not want:
        return
    sec = zero.setdefault(key, {})
    if sec.get("device", AUTO) not in (AUTO, "cpu"):
        raise ConfigError(
            f"{origin}: zero_optimization.{key}.device={sec['device']!r} disagrees with {dotted}=true (cpu)"
        )
    sec["device"] = "cpu"


read_user_config = read_deepspeed_json


def build_deepspeed_config(
    opts: DeepSpeedConfig,
    *,
    per_device: int,
    accumulation: int,
    world_size: int,
    max_grad_norm: float,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """The resolved DeepSpeed config (ZeRO bucket "auto"s are left for :func:`fill_model_sizes`)."""
    origin = opts.config_path or WHERE
    cfg = copy.deepcopy(read_user_config(opts.config_path)) if opts.config_path else {}
    # Read into training.* when the config was loaded (config/deepspeed_json.py); the engine gets
    # alignkit's torch AdamW and schedule, never DeepSpeed's JIT-built optimizers.
    for sec in ("optimizer", "scheduler"):
        cfg.pop(sec, None)
    fill = [
        ("train_micro_batch_size_per_gpu", per_device, "training.per_device_batch_size"),
        ("gradient_accumulation_steps", accumulation, "training.gradient_accumulation_steps"),
        ("train_batch_size", per_device * accumulation * world_size, "per_device x accumulation x world"),
        ("gradient_clipping", float(max_grad_norm), "training.max_grad_norm"),
    ]
    for key, value, source in fill:
        _fill(cfg, key, value, dotted=key, source=source, origin=origin)
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    for sec in ("bf16", "fp16"):
        section = cfg.setdefault(sec, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{origin}: {sec} must be an object like {{\"enabled\": \"auto\"}}")
        if sec == "fp16" and section.get("enabled") is True and dtype_name != sec and not torch.cuda.is_available():
            section["enabled"] = False  # DeepSpeed has no fp16 on CPU; the config load said it is ignored
        _fill(section, "enabled", dtype_name == sec, dotted=f"{sec}.enabled", source="model.dtype is " + dtype_name,
              origin=origin)
    zero = cfg.setdefault("zero_optimization", {})
    if opts.zero_stage is not None:
        _fill(zero, "stage", opts.zero_stage, dotted="zero_optimization.stage", source=f"{WHERE}.zero_stage",
              origin=origin)
    elif zero.get("stage", AUTO) == AUTO:
        zero["stage"] = 2
    stage = int(zero["stage"])
    _offload(zero, "offload_optimizer", opts.offload_optimizer, f"{WHERE}.offload_optimizer", origin)
    _offload(zero, "offload_param", opts.offload_param, f"{WHERE}.offload_param", origin)
    if _offloaded(zero, "offload_param") and stage != 3:
        raise ConfigError(f"{origin}: parameter offload (offload_param) needs ZeRO stage 3, got stage {stage}")
    if _offloaded(zero, "offload_optimizer"):
        if stage == 0:
            raise ConfigError(f"{origin}: optimizer offload (offload_optimizer) needs ZeRO stage 1, 2 or 3")
        # alignkit passes a torch AdamW; DeepSpeed would otherwise insist on its JIT-built CPUAdam.
        cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    cfg.setdefault("steps_per_print", 10**9)  # alignkit logs progress itself
    cfg.setdefault("wall_clock_breakdown", False)
    left = [k for k in _autos(cfg) if k not in MODEL_SIZED]
    if left:
        raise ConfigError(f"{origin}: alignkit has no value for \"auto\" at {left[0]}; give one")
    return cfg


def _offloaded(zero: dict[str, Any], key: str) -> bool:
    sec = zero.get(key)
    return isinstance(sec, dict) and sec.get("device") not in (None, "none")


def offloads_params(cfg: dict[str, Any]) -> bool:
    """True when the resolved config keeps ZeRO-3 parameters on the host (``offload_param``)."""
    return _offloaded(cfg.get("zero_optimization", {}), "offload_param")


def frozen_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of an inference-only ZeRO-3 engine for a frozen model, from the training engine's
    resolved ``cfg``: same batch sizes and precision, stage 3, ``offload_param`` kept; no optimizer,
    scheduler or optimizer offload (a frozen model has no optimizer state)."""
    out = copy.deepcopy(cfg)
    for key in ("optimizer", "scheduler", "zero_force_ds_cpu_optimizer"):
        out.pop(key, None)
    zero = out.setdefault("zero_optimization", {})
    zero["stage"] = 3
    zero.pop("offload_optimizer", None)
    return out


def fill_model_sizes(cfg: dict[str, Any], hidden_size: int | None) -> dict[str, Any]:
    """ZeRO bucket sizes left "auto" get the usual values from the hidden size (as the HF
    Trainer does), or DeepSpeed's defaults when the model has no ``hidden_size``."""
    zero = cfg.get("zero_optimization", {})
    h = int(hidden_size or 0)
    sizes = {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }
    for key, value in sizes.items():
        if zero.get(key) == AUTO:
            if h:
                zero[key] = value
            else:
                del zero[key]
    return cfg


#: "auto" values resolved only once the model is known (see fill_model_sizes).
MODEL_SIZED = {f"zero_optimization.{k}" for k in
               ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")}


def _autos(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _autos(v, f"{path}.{key}" if path else str(key))]
    return [path] if node == AUTO else []
