"""Reading saved weights back into a live model, safely (safetensors only, no pickle)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from alignkit.errors import ModelError
from alignkit.models.sources import corrupt_file_error, first_line, is_safetensors_error


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every ``*.safetensors`` shard in a directory, merged."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors weights found")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except Exception as e:
            if not is_safetensors_error(e):
                raise
            raise corrupt_file_error(f, first_line(e)) from e
    return out


def load_weights_into(model: nn.Module, path: Path) -> None:
    """Copy weights saved by ``save_pretrained`` into ``model`` in place.

    In place (``copy_``) so the optimizer's references to the parameters stay valid. A peft
    model's directory holds the adapter alone; it goes through peft's own key mapping. Tied
    weights that ``save_pretrained`` dropped keep aliasing the loaded tensor they are tied to. A module
    that saves in a format of its own (a diffusers pipeline's) reads it back with its ``load_saved(path)``.
    """
    if callable(getattr(model, "load_saved", None)):
        model.load_saved(path)
        return
    try:
        from peft import PeftModel, set_peft_model_state_dict
        from peft.utils import load_peft_weights
    except ImportError:  # pragma: no cover - peft is a dependency
        PeftModel = ()  # type: ignore[assignment]
    if PeftModel and isinstance(model, PeftModel):
        try:
            set_peft_model_state_dict(model, load_peft_weights(str(path), device="cpu"))
        except RuntimeError as e:  # torch's load_state_dict: "size mismatch for KEY: copying a param with shape ..."
            mismatch = [ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln]
            if not mismatch:
                raise
            raise ModelError(f"{path}: {mismatch[0]} ({len(mismatch)} tensors differ): an adapter of another model") from e
        return
    weights = read_safetensors_dir(path)
    params = dict(model.state_dict(keep_vars=True))
    unexpected = [k for k in weights if k not in params]
    if unexpected:
        raise ModelError(f"{path}: checkpoint has weights the model lacks, e.g. {unexpected[:3]}")
    resized = [k for k, v in weights.items() if v.shape != params[k].shape]
    if resized:
        k = resized[0]
        raise ModelError(f"{path}: {k} has shape {list(weights[k].shape)} in the checkpoint but "
                         f"{list(params[k].shape)} in the model ({len(resized)} tensors differ): a checkpoint of "
                         "another model (another vocabulary or size?)")
    with torch.no_grad():
        for k, v in weights.items():
            params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))
