"""YAML + ``key=value`` overrides -> a validated :class:`RunConfig`.

Errors are :class:`ConfigError` with one line that names the key (dotted path), what was given
and what was expected; an unknown key names the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import math
import sys
import traceback
import types
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from alignkit.config.alias_readers import MISSING, find
from alignkit.config.aliases import apply_aliases, emit_notes, put, read_aliases
from alignkit.config.deepspeed_json import map_deepspeed_json
from alignkit.config.recipes import locate
from alignkit.config.schema import RunConfig
from alignkit.config.sections import ALGORITHMS, registered_sections, require_registrations
from alignkit.config.values import check_range as _check_range
from alignkit.config.values import convert_scalar as _convert_scalar
from alignkit.config.values import freeze_problem
from alignkit.errors import ConfigError

# ---------------------------------------------------------------- reading + overrides


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = locate(path)  # a shipped recipe where configs/NAME.yaml is missing here; the closest one named otherwise
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings (value parsed as YAML: ``1e-4``, ``true``, ``[a, b]``)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. training.learning_rate=1e-4)")
        key, _, text = item.partition("=")
        key = key.strip().lstrip("-")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = {}
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value
    return raw


# ---------------------------------------------------------------- typed conversion


_PLURAL = {int: "integers", float: "numbers", bool: "true/false values", str: "strings"}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        item = typing.get_args(tp)[0]
        return f"a list of {'mappings' if dataclasses.is_dataclass(item) else _PLURAL.get(item) or _type_name(item)}"
    if dataclasses.is_dataclass(tp) or origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string", type(None): "null"}.get(
        tp, str(tp)
    )


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error names the inner key (model.lora.target_modules)
            return _convert(value, options[0], key)
        for arg in options:
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}{hint}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # `data.train: file.jsonl` means a one-element list
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        return _convert_mapping(value, tp, key)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of options, got {value!r}")
        return build_dataclass(tp, value, key)
    return _convert_scalar(value, tp, key)


def _convert_mapping(value: Any, tp: Any, key: str) -> dict[Any, Any]:
    """A ``dict[K, V]`` field: a YAML mapping (null is the empty one), each key and value converted
    (``Any`` keeps the value as YAML read it); the error of an entry names it (``agent.env_args.digits``)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping (key: value, e.g. {{digits: 2}}), got {value!r}")
    key_tp, value_tp = typing.get_args(tp) or (Any, Any)
    return {_convert(k, key_tp, f"{key} (a key)"): _convert(v, value_tp, f"{key}.{k}") for k, v in value.items()}


def _empty_by_default(fld: dataclasses.Field) -> bool:
    """An optional list: its default is the empty list (a list with a default of its own is not optional)."""
    factory = fld.default_factory
    return factory is not dataclasses.MISSING and factory() == []


def build_dataclass(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    sections: dict[str, type] = {}
    if cls is RunConfig:  # the registered per-algorithm sections read like core ones
        sections = registered_sections()
    valid = [*fields, *sections]
    for name in raw:
        if name not in valid:
            full = f"{prefix}.{name}" if prefix else str(name)
            close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
            hint = f"; did you mean {((prefix + '.') if prefix else '') + close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {full!r}{hint} (valid here: {', '.join(valid)})")
    read_raw = getattr(cls, "read_raw", None)
    if read_raw is not None:  # a section's own shorthand (data.train as {path, weight} entries)
        raw = read_raw(raw, prefix or cls.__name__)
    kwargs: dict[str, Any] = {}
    if sections:
        kwargs["sections"] = {name: _convert(raw.get(name), sec, name) for name, sec in sections.items()}
    for name, fld in fields.items():
        if name not in raw:
            continue
        key = f"{prefix}.{name}" if prefix else name
        if raw[name] is None and _empty_by_default(fld):  # `data.eval=null`: an optional list, none
            kwargs[name] = []
            continue
        value = _convert(raw[name], hints[name], key)
        _check_range(value, dict(fld.metadata), key)
        kwargs[name] = value
    built = cls(**kwargs)
    built.__dict__[_GIVEN] = frozenset(kwargs)  # not a field: to_dict and == ignore it
    return built


_GIVEN = "_given_keys"


def given_keys(cfg: Any) -> frozenset[str]:
    """The fields of a config dataclass that its YAML (or an override) set, the others holding their defaults;
    empty for one built in code. A section whose default depends on another section's value reads it."""
    return cfg.__dict__.get(_GIVEN, frozenset())


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dicts; a RunConfig's algorithm sections appear at the top level, as in YAML."""
    out = dataclasses.asdict(cfg)
    if isinstance(cfg, RunConfig):
        out.pop("sections", None)
        for name, cls in registered_sections().items():
            out[name] = dataclasses.asdict(cfg.section(cls))
    return out


# ---------------------------------------------------------------- cross-field checks


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic for one run: global = per_device x accumulation x world."""

    per_device: int
    accumulation: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.per_device * self.accumulation * self.world_size


def resolve_batch(cfg: RunConfig, world_size: int) -> BatchPlan:
    t = cfg.training
    ga = t.gradient_accumulation_steps
    if t.per_device_batch_size is None and t.global_batch_size is None:
        raise ConfigError("training: give training.per_device_batch_size or training.global_batch_size")
    if t.global_batch_size is not None:
        denom = ga * world_size
        if t.global_batch_size % denom:
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by "
                f"gradient_accumulation_steps={ga} x world_size={world_size} = {denom}"
            )
        per_device = t.global_batch_size // denom
        if t.per_device_batch_size is not None and t.per_device_batch_size != per_device:
            raise ConfigError(
                f"training.per_device_batch_size={t.per_device_batch_size} disagrees with "
                f"global_batch_size={t.global_batch_size} / ({ga} x {world_size}) = {per_device}; give only one"
            )
        return BatchPlan(per_device, ga, world_size)
    return BatchPlan(t.per_device_batch_size, ga, world_size)  # type: ignore[arg-type]


def scaled_learning_rate(cfg: RunConfig, plan: BatchPlan) -> float:
    """learning_rate x (B / B_ref) for linear, x sqrt(B / B_ref) for sqrt (ALGORITHMS 6.3)."""
    t = cfg.training
    if t.lr_scaling == "none":
        return t.learning_rate
    ratio = plan.global_batch / t.reference_batch_size  # type: ignore[operator]
    return t.learning_rate * (ratio if t.lr_scaling == "linear" else math.sqrt(ratio))


def validate(cfg: RunConfig) -> None:
    """Checks that need more than one field; run once after building."""
    require_registrations()
    if cfg.algorithm not in ALGORITHMS:  # alignkit.algorithms (and plugins) registered them
        names = ALGORITHMS.names()
        close = difflib.get_close_matches(cfg.algorithm, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"algorithm: unknown {cfg.algorithm!r}{hint}; choose one of {names}")
    if not cfg.model.name_or_path:
        raise ConfigError("model.name_or_path: required (a hub id or a local model directory)")
    if problem := freeze_problem(cfg.model.freeze, cfg.model.lora):  # before any model is read
        raise ConfigError(problem)
    if not cfg.data.train:
        raise ConfigError("data.train: required (one or more .jsonl/.parquet files or builtin:NAME)")
    t = cfg.training
    if cfg.data.streaming and t.max_steps is None:
        raise ConfigError("data.streaming: needs training.max_steps (a stream's length is not known ahead)")
    if cfg.data.streaming and cfg.data.max_train_examples is not None:
        raise ConfigError("data.max_train_examples: not used with data.streaming (training.max_steps bounds the run)")
    if t.per_device_batch_size is None and t.global_batch_size is None:
        raise ConfigError("training: give training.per_device_batch_size or training.global_batch_size")
    if t.lr_scaling != "none" and t.reference_batch_size is None:
        raise ConfigError(f"training.reference_batch_size: required when training.lr_scaling={t.lr_scaling!r}")
    unknown_sinks = set(cfg.logging.report_to) - {"console", "jsonl", "tensorboard", "wandb"}
    if unknown_sinks:
        raise ConfigError(
            f"logging.report_to: unknown sink(s) {sorted(unknown_sinks)}; choose from console, jsonl, tensorboard, wandb"
        )
    if cfg.hub.push_to_hub and not cfg.checkpoint.save_final:
        raise ConfigError("hub.push_to_hub: needs checkpoint.save_final=true (the push uploads output_dir/final)")
    rf = cfg.checkpoint.resume_from
    if rf not in (None, "latest") and not Path(rf).exists():
        raise ConfigError(f"checkpoint.resume_from: {rf!r} does not exist (use null, latest or a checkpoint path)")
    ALGORITHMS.get(cfg.algorithm).check_config(cfg)


#: old dotted key -> its replacement; read with a FutureWarning (resolved configs saved before the rename)
RENAMED = {"distributed.fsdp.shard_frozen": "distributed.shard_frozen"}


def rename_deprecated(raw: dict[str, Any]) -> dict[str, Any]:
    """Move each :data:`RENAMED` key of ``raw`` to its new place, warning once per key; giving both
    with different values is an error."""
    for old, new in RENAMED.items():
        *old_parents, old_leaf = old.split(".")
        node = raw
        for part in old_parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or old_leaf not in node:
            continue
        value = node.pop(old_leaf)
        warnings.warn(f"config key {old!r} is deprecated; use {new!r}", FutureWarning, stacklevel=3)
        *new_parents, new_leaf = new.split(".")
        target = raw
        for part in new_parents:
            target = target.setdefault(part, {})
        if new_leaf in target and target[new_leaf] != value:
            raise ConfigError(
                f"{old}={value!r} (deprecated) disagrees with {new}={target[new_leaf]!r}; give only {new}"
            )
        target[new_leaf] = value
    return raw


def overlay(raw: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Apply ``key=value`` overrides to the (native) file dict ``raw``; an override may be an alias too
    (read on its own, so it wins over the file like any override). Returns ``raw`` and the alias notes."""
    if not overrides:
        return raw, []
    over = rename_deprecated(apply_overrides({}, overrides))
    over, notes, targets = read_aliases(over, given=raw)
    keys = [item.partition("=")[0].strip().lstrip("-") for item in overrides]
    for key in [RENAMED.get(k, k) for k in keys] + targets:
        value = find(over, key)  # an alias key is gone from ``over`` by now; its targets follow
        if value is not MISSING:
            put(raw, key, value, replace=True)
    return raw, notes


def native_raw(path: str | Path | None, overrides: list[str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The config file plus overrides as one native dict, and one note per key read from elsewhere:
    deprecated keys renamed, HF / seed-guide aliases read (config/aliases.py), then the DeepSpeed JSON's
    optimizer, scheduler, batch and precision read into training.* (config/deepspeed_json.py)."""
    raw = rename_deprecated(read_yaml(path) if path is not None else {})
    raw, notes = apply_aliases(raw)
    raw, more = overlay(raw, list(overrides or []))
    return raw, notes + more + map_deepspeed_json(raw)


def _plugin_line(name: str, e: BaseException) -> str:
    """``file:line`` of the plugin ``name``'s own file where ``e`` came from (else the last frame outside
    importlib's machinery)."""
    spec = importlib.util.find_spec(name)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen")]
    own = [f for f in frames if spec is not None and f.filename == spec.origin] or frames
    return f"{own[-1].filename}:{own[-1].lineno}" if own else "?"


def import_plugins(modules: Any) -> None:
    """Import the config's ``plugins`` (before its sections and algorithm are checked, since a plugin may
    register them), with the working directory importable as ``python -m`` has it."""
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"plugins: expected a list of module names (e.g. [my_pkg.my_algo]), got {modules!r}")
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"plugins: cannot import {name!r} ({e})") from None
        except SyntaxError as e:  # the plugin's own file: its line, not a traceback wall
            raise ConfigError(f"plugins: {name!r}: {e.filename}:{e.lineno}: {e.msg}") from None
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the plugin's own failure (a name registered twice, a bug): one line
            raise ConfigError(f"plugins: importing {name!r} failed at {_plugin_line(name, e)}: "
                              f"{type(e).__name__}: {e}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None, *, notes: bool = True) -> RunConfig:
    """The validated run config. ``notes``: say (rank 0, one line each) how keys from elsewhere were read;
    off where the same config is loaded again right after (``alignkit launch`` checks it before its ranks do)."""
    raw, said = native_raw(path, overrides)
    if notes:
        emit_notes(said)
    import_plugins(raw.get("plugins") or [])
    cfg = build_dataclass(RunConfig, raw)
    validate(cfg)
    return cfg


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
