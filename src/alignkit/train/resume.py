"""What a resume may change: the checkpoint's saved resolved config against the run's.

Resuming continues ONE run. Keys that define what is trained (the algorithm and its section, the
model, the data, the seed and the optimizer's own hyper-parameters) must be equal, else the resume is
a one-line error listing them (``checkpoint.resume_weights_only: true`` starts a new run from the
weights instead). Everything else may change and is applied, each change logged: the learning rate
and its schedule (rebuilt at the resumed step from the new values), the step budget, batch layout and
world size, logging, checkpointing, the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from alignkit.config.aliases import apply_aliases
from alignkit.config.sections import registered_sections
from alignkit.errors import ConfigError

#: changes to these keys (dotted, or a prefix ending in ".") are not a resume of the same run
FIXED = ("algorithm", "model.", "data.", "training.seed", "training.weight_decay", "training.adam_beta1",
         "training.adam_beta2", "training.adam_epsilon")
#: ... except these, which change how the same thing is computed, not what is trained
HARMLESS = ("model.gradient_checkpointing", "model.attn_implementation", "data.num_workers", "data.eval",
            "data.max_eval_examples", "data.eval_split", "data.eval_config", "data.num_proc", "data.cache_dir",
            "flow_sft.cache_encodings")
#: a change here means the LR schedule is rebuilt from the new values at the resumed step
SCHEDULE = ("training.learning_rate", "training.lr_scaling", "training.reference_batch_size",
            "training.lr_scheduler", "training.warmup_steps", "training.warmup_ratio", "training.min_lr_ratio",
            "training.max_steps", "training.epochs", "training.per_device_batch_size", "training.global_batch_size",
            "training.gradient_accumulation_steps")


def changes(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old, new) of every leaf that differs; a key only one side has is a field that was
    added or removed since (its default applies), not a change. ``None`` vs a mapping (LoRA switched
    on) is one change of the whole value."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in old:
            if k in new:
                out += changes(old[k], new[k], f"{prefix}{k}.")
        return out
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def saved_config(ckpt: Path) -> dict[str, Any] | None:
    path = ckpt / "config.yaml"
    if not path.is_file():
        return None
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        return None
    # a checkpoint written before a key moved (reward.pair -> reward_model.pair) compares under the new names
    return apply_aliases(data)[0]


def compare(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(keys that may not change but did, keys that changed and are applied), as ``key: old -> new``."""
    fixed_all = FIXED + tuple(f"{name}." for name in registered_sections())
    fixed, allowed = [], []
    for key, a, b in changes(saved, current):
        line = f"{key}: {a!r} -> {b!r}"
        (fixed if _matches(key, fixed_all) and not _matches(key, HARMLESS) else allowed).append(line)
    return fixed, allowed


def check_same_run(path: Path, config_yaml: str) -> list[str]:
    """Refuse the checkpoint ``path`` of another run than the resolved ``config_yaml`` in one line; the allowed
    changes (``key: old -> new``) otherwise (none for a checkpoint without its config)."""
    saved = saved_config(path)
    if saved is None:
        return []
    fixed, allowed = compare(saved, yaml.safe_load(config_yaml))
    if fixed:
        shown = "; ".join(fixed[:4]) + (f"; and {len(fixed) - 4} more" if len(fixed) > 4 else "")
        raise ConfigError(f"checkpoint.resume_from: {path} was written by another run ({shown}); a resume "
                          "continues the same run: set checkpoint.resume_weights_only=true to start a new run "
                          "from its weights")
    return allowed


def schedule_changed(allowed: list[str]) -> bool:
    return any(_matches(line.split(":", 1)[0], SCHEDULE) for line in allowed)


def fast_forward(scheduler: Any, step: int) -> None:
    """Put a freshly built ``LambdaLR`` (new base LR and shape) at ``step``, on the optimizer whose
    param groups were just restored from a checkpoint (their lr/initial_lr are the old run's)."""
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, base, lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, lrs):
        group["initial_lr"], group["lr"] = base, lr
    scheduler._last_lr = lrs
