"""Leaf conversions of the config loader (``loader.py``): a YAML value as a plain field type, and a number
checked against a field's range rules (``gt``, ``ge``, ``le``). Errors are one-line :class:`ConfigError` naming
the key."""

from __future__ import annotations

import math
import re
from typing import Any

from alignkit.errors import ConfigError


def convert_scalar(value: Any, tp: Any, key: str) -> Any:
    """``value`` as the plain type ``tp`` (bool, int, float, str; ``Any`` as it is), with YAML's spellings of
    each accepted."""
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads `1e-4` as a string; accept any float literal
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover - schema bug


def check_range(value: Any, meta: dict[str, Any], key: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if "gt" in meta and not value > meta["gt"]:
        raise ConfigError(f"{key}: must be > {meta['gt']}, got {value!r}")
    if "ge" in meta and not value >= meta["ge"]:
        raise ConfigError(f"{key}: must be >= {meta['ge']}, got {value!r}")
    if "le" in meta and not value <= meta["le"]:
        raise ConfigError(f"{key}: must be <= {meta['le']}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")


def freeze_problem(patterns: list[str], lora: Any) -> str | None:
    """What is wrong with ``model.freeze`` before any model is read (one line), or None: beside ``model.lora``, or
    an expression that is not a regular expression (one matching no parameter needs the model: models/loading.py)."""
    if patterns and lora is not None:
        return "model.freeze: not with model.lora (LoRA trains only its adapters already); set one of them"
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            return f"model.freeze: {pattern!r} is not a regular expression ({e})"
    return None
