"""``alignkit migrate``: a config written with HF / seed-guide keys, rewritten in alignkit's own keys.

The same reading as :func:`alignkit.config.load_config` (deprecated keys renamed, aliases read, see
config/aliases.py) on the file alone, then checked against the typed sections. A native config
comes back unchanged (as data: YAML comments are not kept). A DeepSpeed JSON named by the config
stays as it is: it is read at every load (config/deepspeed_json.py).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from alignkit.config.aliases import apply_aliases
from alignkit.config.loader import build_dataclass, read_yaml, rename_deprecated
from alignkit.config.schema import RunConfig


def migrate_raw(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``raw`` in native keys (a copy) and one note per alias read."""
    out, notes = apply_aliases(rename_deprecated(copy.deepcopy(raw)))
    build_dataclass(RunConfig, copy.deepcopy(out))  # every key is native now; an unknown one is named
    if notes:  # sections in the schema's order (algorithm, output_dir, model, data, training, ...)
        order = [f.name for f in dataclasses.fields(RunConfig)]
        out = dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    return out, notes


def migrate_file(path: str | Path) -> tuple[str, list[str]]:
    """The native YAML text of the config at ``path`` and the notes."""
    out, notes = migrate_raw(read_yaml(path))
    return yaml.safe_dump(out, sort_keys=False, allow_unicode=True), notes
