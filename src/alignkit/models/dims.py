"""A model's dimensions for the memory estimator, from a preset name or its folder: what the kinds' ``dims``
and the planner (``planner/auto.py``) read."""

from __future__ import annotations

from alignkit.errors import ModelError
from alignkit.models.adapter_dirs import adapter_base, is_adapter_dir
from alignkit.models.sources import check_hub
from alignkit.planner.model_dims import PRESETS, ModelDims, dims_from_pretrained


def resolve_dims(spec: str, trust_remote_code: bool = False) -> ModelDims:
    """A preset name (``llama-7b``, ...) or a local model / LoRA adapter directory."""
    if spec in PRESETS:
        return PRESETS[spec]
    check_hub(spec)
    path = adapter_base(spec) if is_adapter_dir(spec) else spec
    try:
        return dims_from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read the model dimensions of {spec!r} ({first}); give a local model "
                         f"directory or a preset: {', '.join(PRESETS)}") from None
