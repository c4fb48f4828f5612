"""A DeepSpeed JSON users already have (``distributed.deepspeed.config_path``), read at load time.

Its ``optimizer`` (Adam/AdamW) and ``scheduler`` (WarmupLR, WarmupDecayLR, WarmupCosineLR) sections,
batch sizes, ``gradient_clipping`` and ``bf16``/``fp16`` become ``training.*`` / ``model.dtype`` where
the YAML leaves them unset, with one note per section; a YAML value that disagrees is a one-line
ConfigError naming both. So ``alignkit validate`` shows the result and the batch plan uses it.
"auto" values are left alone (filled from training.* when the engine config is built).

The engine is still given alignkit's torch AdamW and LR schedule (DeepSpeed's own optimizers are
JIT-compiled; ENGINES_ON_CPU.md), so ``build_deepspeed_config`` drops the two sections afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from alignkit.config.alias_readers import lookup, same, show
from alignkit.config.aliases import put
from alignkit.errors import ConfigError

AUTO = "auto"
WHERE = "distributed.deepspeed.config_path"


def read_deepspeed_json(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{WHERE}: {path!r} does not exist")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{WHERE}: {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{WHERE}: {path} must hold a JSON object")
    return data


class _Reader:
    """Takes JSON values into the raw YAML dict: unset -> set, equal -> kept, different -> error."""

    def __init__(self, raw: dict[str, Any], name: str) -> None:
        self.raw, self.name = raw, name

    def given(self, target: str) -> Any:
        value = lookup(self.raw, target)
        return None if target == "model.dtype" and value == AUTO else value

    def take(self, target: str, value: Any, source: str, read: list[str], written: Any = None) -> None:
        """``written``: the JSON's own value when it differs from ``value`` (fp16.enabled=true -> fp16)."""
        if value is None or value == AUTO:
            return
        have = self.given(target)
        if have is None:
            put(self.raw, target, value)
        elif not same(have, value):
            shown = show(value if written is None else written)
            raise ConfigError(f"{self.name}: {source}={shown} disagrees with {target}={show(have)}; give one "
                              f"(or set {source} to \"auto\")")
        read.append(f"{target}={show(value)}")

    def note(self, what: str, read: list[str], why: str = "") -> str | None:
        if not read:
            return None
        return f"config: {self.name} {what} read as {', '.join(read)}" + (f" ({why})" if why else "")


# ---------------------------------------------------------------- sections

_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad"}


def _peak_lr(ds: dict[str, Any]) -> tuple[Any, str]:
    """The JSON's peak learning rate and where it came from: a Warmup(Decay)LR's warmup_max_lr
    overrides the optimizer's lr in DeepSpeed (WarmupDecayLR defaults it to 0.001)."""
    opt = (ds.get("optimizer") or {}).get("params") or {}
    sched = ds.get("scheduler") or {}
    params = sched.get("params") or {}
    kind = sched.get("type")
    if kind in ("WarmupLR", "WarmupDecayLR") and params.get("warmup_max_lr") is not None:
        return params["warmup_max_lr"], "scheduler.params.warmup_max_lr"
    if kind == "WarmupDecayLR":
        return 0.001, "scheduler WarmupDecayLR's default warmup_max_lr"
    return opt.get("lr"), "optimizer.params.lr"


def _optimizer(ds: dict[str, Any], r: _Reader) -> str | None:
    sec = ds.get("optimizer")
    if sec is None:
        return None
    kind = str(sec.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"{r.name}: optimizer type {sec.get('type')!r} has no alignkit equivalent; alignkit trains "
                          "with torch AdamW from training.* (use type AdamW or remove the section)")
    params = dict(sec.get("params") or {})
    unknown = sorted(set(params) - _ADAM_PARAMS)
    if unknown:
        raise ConfigError(f"{r.name}: optimizer.params.{unknown[0]} is not read; alignkit's AdamW takes lr, betas, "
                          "eps and weight_decay")
    if params.get("bias_correction", True) is not True or params.get("amsgrad", False) is not False:
        raise ConfigError(f"{r.name}: optimizer bias_correction=false / amsgrad=true cannot be honoured by "
                          "alignkit's AdamW")
    if kind == "adam" and params.get("adam_w_mode", True) is False and params.get("weight_decay", 0) not in (0, 0.0):
        raise ConfigError(f"{r.name}: optimizer Adam with adam_w_mode=false (L2 weight decay) cannot be honoured; "
                          "alignkit uses AdamW (decoupled decay): set adam_w_mode true or weight_decay 0")
    read: list[str] = []
    lr, lr_from = _peak_lr(ds)
    r.take("training.learning_rate", lr, lr_from, read)
    betas = params.get("betas")
    if isinstance(betas, (list, tuple)) and len(betas) == 2:
        r.take("training.adam_beta1", betas[0], "optimizer.params.betas[0]", read)
        r.take("training.adam_beta2", betas[1], "optimizer.params.betas[1]", read)
    elif betas not in (None, AUTO):
        raise ConfigError(f"{r.name}: optimizer.params.betas must be [beta1, beta2], got {betas!r}")
    r.take("training.adam_epsilon", params.get("eps"), "optimizer.params.eps", read)
    r.take("training.weight_decay", params.get("weight_decay"), "optimizer.params.weight_decay", read)
    why = "alignkit's torch AdamW; no decay on biases and norms"
    if lr_from != "optimizer.params.lr" and params.get("lr") not in (None, AUTO) and not same(params["lr"], lr):
        why += f"; {lr_from} overrides optimizer lr={show(params['lr'])}, as in DeepSpeed"
    return r.note(f"optimizer {sec.get('type')}", read, why)


def _scheduler(ds: dict[str, Any], r: _Reader) -> str | None:
    sec = ds.get("scheduler")
    if sec is None:
        return None
    kind = sec.get("type")
    p = dict(sec.get("params") or {})
    shapes = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
    if kind not in shapes:
        raise ConfigError(f"{r.name}: scheduler type {kind!r} has no alignkit equivalent; use WarmupLR, WarmupDecayLR "
                          "or WarmupCosineLR, or remove the section and set training.lr_scheduler")
    read: list[str] = []
    why: list[str] = []
    r.take("training.lr_scheduler", shapes[kind], "scheduler.type", read)
    if "optimizer" not in ds:  # otherwise _optimizer took it
        lr, lr_from = _peak_lr(ds)
        if lr_from != "optimizer.params.lr":
            r.take("training.learning_rate", lr, lr_from, read)
    warmup = p.get("warmup_num_steps", 1000)  # DeepSpeed's default
    if warmup != AUTO and r.given("training.warmup_steps") is None and (r.given("training.warmup_ratio") or 0):
        raise ConfigError(f"{r.name}: scheduler.params.warmup_num_steps={show(warmup)} and training.warmup_ratio="
                          f"{show(r.given('training.warmup_ratio'))} both set the warmup; give one")
    r.take("training.warmup_steps", warmup, "scheduler.params.warmup_num_steps", read)
    if p.get("warmup_type", "log") != "linear":
        why.append("linear warmup; DeepSpeed's default is log")
    if kind == "WarmupCosineLR":
        r.take("training.min_lr_ratio", p.get("cos_min_ratio", 0.0001), "scheduler.params.cos_min_ratio", read)
        if p.get("warmup_min_ratio", 0) not in (0, 0.0, AUTO):
            why.append(f"warmup starts near 0, not warmup_min_ratio={show(p['warmup_min_ratio'])}")
    elif p.get("warmup_min_lr", 0) not in (0, 0.0, AUTO):
        if kind == "WarmupDecayLR":
            peak, _ = _peak_lr(ds)
            if peak != AUTO:
                r.take("training.min_lr_ratio", float(p["warmup_min_lr"]) / float(peak),
                       "scheduler.params.warmup_min_lr / warmup_max_lr", read)
        why.append(f"warmup starts near 0, not warmup_min_lr={show(p['warmup_min_lr'])}")
    if kind != "WarmupLR":
        total = p.get("total_num_steps")
        epochs = r.given("training.epochs")
        if total not in (None, AUTO) and r.given("training.max_steps") is None and epochs is not None:
            raise ConfigError(f"{r.name}: scheduler.params.total_num_steps={show(total)} and training.epochs="
                              f"{show(epochs)} both fix the run length; give training.max_steps or set "
                              "total_num_steps to \"auto\"")
        r.take("training.max_steps", total, "scheduler.params.total_num_steps", read)
    return r.note(f"scheduler {kind}", read, "; ".join(why))


def _batch(ds: dict[str, Any], r: _Reader) -> str | None:
    read: list[str] = []
    why = ""
    micro, gas, total = (ds.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                               "train_batch_size"))
    if micro not in (None, AUTO) and r.given("training.global_batch_size") is None:
        r.take("training.per_device_batch_size", micro, "train_micro_batch_size_per_gpu", read)
    r.take("training.gradient_accumulation_steps", gas, "gradient_accumulation_steps", read)
    if total not in (None, AUTO):
        if r.given("training.per_device_batch_size") is None:
            r.take("training.global_batch_size", total, "train_batch_size", read)
        else:  # DeepSpeed's rule, which needs the number of processes: checked when the engine is built
            why = f"train_batch_size={show(total)} must equal per device x accumulation x processes"
    r.take("training.max_grad_norm", ds.get("gradient_clipping"), "gradient_clipping", read)
    return r.note("batch", read, why)


def _precision(ds: dict[str, Any], r: _Reader, *, cuda: bool | None) -> str | None:
    on = [sec for sec in ("bf16", "fp16") if isinstance(ds.get(sec), dict) and ds[sec].get("enabled") is True]
    if len(on) > 1:
        raise ConfigError(f"{r.name}: bf16.enabled and fp16.enabled are both true; enable one")
    if not on:
        return None
    if on[0] == "fp16":
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        if not cuda:
            dtype = r.given("model.dtype") or AUTO
            return (f"config: {r.name} fp16.enabled=true is ignored on this CPU run: DeepSpeed cannot train in fp16 "
                    f"on CPU (model.dtype stays {dtype})")
    read: list[str] = []
    r.take("model.dtype", on[0], f"{on[0]}.enabled", read, written=True)
    return r.note(on[0], read)


def map_deepspeed_json(raw: dict[str, Any], *, cuda: bool | None = None) -> list[str]:
    """Read ``distributed.deepspeed.config_path`` (if any) into ``raw`` (in place); one note per
    section read. ``cuda`` (default: ``torch.cuda.is_available()``) decides whether fp16 can be honoured."""
    path = lookup(raw, WHERE)
    if not isinstance(path, str) or not path:
        return []
    ds = read_deepspeed_json(path)
    r = _Reader(raw, Path(path).name)
    notes = [_optimizer(ds, r), _scheduler(ds, r), _batch(ds, r), _precision(ds, r, cuda=cuda)]
    return [n for n in notes if n]
