"""Reading saved weights back into a live model, safely (safetensors only, no pickle)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from alignkit.errors import ModelError


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every ``*.safetensors`` shard in a directory, merged."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors weights found")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def load_weights_into(model: nn.Module, path: Path) -> None:
    """Copy weights saved by ``save_pretrained`` into ``model`` in place.

    In place (``copy_``) so the optimizer's references to the parameters stay valid. A peft
    model's directory holds the adapter alone; it goes through peft's own key mapping. Tied
    weights that ``save_pretrained`` dropped keep aliasing the loaded tensor they are tied to.
    """
    try:
        from peft import PeftModel, set_peft_model_state_dict
        from peft.utils import load_peft_weights
    except ImportError:  # pragma: no cover - peft is a dependency
        PeftModel = ()  # type: ignore[assignment]
    if PeftModel and isinstance(model, PeftModel):
        set_peft_model_state_dict(model, load_peft_weights(str(path), device="cpu"))
        return
    weights = read_safetensors_dir(path)
    params = dict(model.state_dict(keep_vars=True))
    unexpected = [k for k in weights if k not in params]
    if unexpected:
        raise ModelError(f"{path}: checkpoint has weights the model lacks, e.g. {unexpected[:3]}")
    with torch.no_grad():
        for k, v in weights.items():
            params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))
