"""``alignkit tiny-model OUT --arch sd3``: a tiny random SD3 pipeline that diffusers' own
``StableDiffusion3Pipeline.from_pretrained`` loads and that renders a 32x32 image on CPU, the same image under
the same seed."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from alignkit.cli import main
from alignkit.models.tiny_sd3 import IMAGE_SIZE, TEXT_LENGTH

pytest.importorskip("diffusers")


def render(pipe: object, prompts: list[str], seed: int) -> np.ndarray:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = pipe(prompt=prompts, num_inference_steps=4, guidance_scale=4.5, generator=gen, max_sequence_length=8,
               output_type="np")  # type: ignore[operator]
    return out.images


def test_tiny_sd3_loads_in_diffusers_and_renders_deterministically(tmp_path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    assert main(["tiny-model", str(tmp_path / "sd3"), "--arch", "sd3", "--size", "micro", "--vae-steps", "0"]) == 0
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "sd3")
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler) and pipe.text_encoder_3 is not None
    ids = pipe.tokenizer("a red circle")["input_ids"]
    assert ids[0] == pipe.tokenizer.bos_token_id and ids[-1] == pipe.tokenizer.eos_token_id  # CLIP pools at eos
    assert pipe.tokenizer.model_max_length == TEXT_LENGTH
    assert pipe.tokenizer_3("a red circle")["input_ids"][-1] == pipe.tokenizer_3.eos_token_id
    start = time.perf_counter()
    a = render(pipe, ["a red circle in the top left", "a blue square"], seed=0)
    took = time.perf_counter() - start
    assert a.shape == (2, IMAGE_SIZE, IMAGE_SIZE, 3) and np.isfinite(a).all()
    assert took < 10, f"rendering two 32x32 images took {took:.1f}s"
    b = render(pipe, ["a red circle in the top left", "a blue square"], seed=0)
    c = render(pipe, ["a red circle in the top left", "a blue square"], seed=1)
    assert np.array_equal(a, b)  # same seed, same images
    assert np.abs(a - c).max() > 1e-4  # another seed, other noise
    assert np.abs(a[0] - a[1]).max() > 1e-4  # the prompt reaches the image


def test_tiny_sd3_weights_are_deterministic(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from alignkit.models.tiny_sd3 import build_tiny_sd3

    paths = [build_tiny_sd3(tmp_path / name, size="micro", seed=seed) for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    weights = [load_file(str(p / "transformer" / "diffusion_pytorch_model.safetensors")) for p in paths]
    assert weights[0].keys() == weights[1].keys()
    assert all((weights[0][k] == weights[1][k]).all() for k in weights[0])
    assert any((weights[0][k] != weights[2][k]).any() for k in weights[0])


def test_fit_vae_learns_to_reconstruct_the_shapes_scenes() -> None:
    """A random VAE decodes to colour noise; fitted on the shapes scenes its reconstructions approach them."""
    import torch

    from alignkit.models.tiny_sd3 import fit_vae, tiny_vae

    torch.manual_seed(0)
    vae = tiny_vae()
    start = fit_vae(vae, steps=1, seed=0, lr=0.0)
    end = fit_vae(vae, steps=60, seed=1)
    assert end < 0.5 * start, (start, end)
