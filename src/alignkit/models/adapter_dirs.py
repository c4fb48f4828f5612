"""LoRA adapter directories, recognised by their files: a peft model's ``save_pretrained`` writes the adapter
alone (``adapter_config.json`` + ``adapter_model.safetensors``, plus ``modules_to_save`` copies such as a reward
model's score head); the base model is named by ``base_model_name_or_path`` in the config. Reading them needs
no model code, so model loading, the estimator and the commands ask here (``models/adapters.py`` loads them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from alignkit.errors import ModelError

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text(encoding="utf-8"))


def adapter_base(path: str | Path, base: str | None = None) -> str:
    """The base model of an adapter directory (``base`` overrides the recorded one)."""
    if base:
        return base
    recorded = adapter_config(path).get("base_model_name_or_path")
    if not recorded:
        raise ModelError(f"{path}: {ADAPTER_CONFIG} names no base_model_name_or_path; pass the base model explicitly")
    return recorded
