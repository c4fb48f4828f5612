"""A tiny random SD3-class flow-matching text-to-image pipeline, in diffusers' format.

``build_tiny_sd3`` writes a directory that ``StableDiffusion3Pipeline.from_pretrained`` (or
``DiffusionPipeline.from_pretrained``) loads like a hub checkpoint: a small ``SD3Transformer2DModel`` (MMDiT),
a small ``AutoencoderKL`` (4 latent channels, one 2x downsampling: a 32x32 image is a 16x16 latent, 64 patch
tokens of 2x2), two tiny CLIP text encoders with projection and a tiny T5 encoder (SD3's three) and a
``FlowMatchEulerDiscreteScheduler``. (A pipeline saved without T5 does not load by ``from_pretrained`` alone:
diffusers wants ``text_encoder_3=None`` passed, so the tiny one ships a T5.)

The tokenizers are the tiny byte-level BPE that alignkit trains for its tiny LMs
(:func:`alignkit.models.tiny_base.train_tokenizer`, no download): for the CLIPs with bos and eos around every text
as CLIP's own tokenizer does (the text encoder pools its output at the eos token) and 77 positions, for T5
with an eos after the text as T5's does. Pass ``max_sequence_length`` (T5 tokens, 256 by default) to the
pipeline for fast renders.

Random weights: the pipeline renders noise-like images until it is trained (``algorithm: flow_sft``).
Deterministic: the same arguments give the same files.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from alignkit.data.captions import pil_pixels
from alignkit.data.synth_vlm import CANVAS, draw, make_scene
from alignkit.models.diffusion import quiet_diffusers
from alignkit.models.tiny_base import _check_choice, train_tokenizer
from alignkit.progress import track

#: positions of the CLIP text encoders (and their tokenizers' ``model_max_length``), as CLIP's
TEXT_LENGTH = 77
#: the tokenizers' vocabulary (the tiny LMs'): whole words for the shapes captions, which fit 77 tokens
VOCAB_SIZE = 8192
#: default image side in pixels (the transformer's ``sample_size`` is in latent pixels: this / 2)
IMAGE_SIZE = 32
#: transformer shapes: (layers, attention heads, head dim); CLIP: (hidden, layers)
SD3_SIZES: dict[str, dict[str, tuple[int, ...]]] = {
    "micro": {"transformer": (1, 2, 16), "clip": (32, 2)},
    "tiny": {"transformer": (2, 4, 16), "clip": (32, 2)},
    "small": {"transformer": (4, 4, 32), "clip": (64, 2)},
}


def framed_tokenizer(base: Any, *, bos: bool, max_length: int) -> Any:
    """A copy of the tiny BPE tokenizer ``base`` adding (bos +) text + eos, ``max_length`` positions: CLIP's
    framing with ``bos``, T5's without."""
    tok = copy.deepcopy(base)
    tok.add_bos_token = bos  # the setters rebuild the post-processor (transformers' TokenizersBackend)
    tok.add_eos_token = True
    tok.model_max_length = max_length
    return tok


def _t5_encoder(tok: Any, d_model: int) -> Any:
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=len(tok), d_model=d_model, d_kv=16, d_ff=2 * d_model, num_layers=1, num_heads=4,
                   relative_attention_num_buckets=8, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   decoder_start_token_id=tok.pad_token_id)
    return T5EncoderModel(cfg)


def _clip_encoder(tok: Any, hidden: int, layers: int) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, max_position_embeddings=TEXT_LENGTH,
                         projection_dim=hidden, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    return CLIPTextModelWithProjection(cfg)


def tiny_vae() -> Any:
    """A random ``AutoencoderKL``: 4 latent channels, one 2x downsampling."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=IMAGE_SIZE,
                         use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.0, shift_factor=0.0)


def tiny_sd3_parts(size: str = "tiny", vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    """The pipeline's components (random weights from the global generator), by the pipeline's argument names."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    _check_choice("size", size, SD3_SIZES)
    layers, heads, head_dim = SD3_SIZES[size]["transformer"]
    hidden, clip_layers = SD3_SIZES[size]["clip"]
    base = train_tokenizer(vocab_size)
    tok = framed_tokenizer(base, bos=True, max_length=TEXT_LENGTH)
    t5_tok = framed_tokenizer(base, bos=False, max_length=256)
    enc1, enc2 = _clip_encoder(tok, hidden, clip_layers), _clip_encoder(tok, hidden, clip_layers)
    t5 = _t5_encoder(t5_tok, 2 * hidden)
    # joint_attention_dim: T5's width, to which SD3 pads the two CLIPs' concatenated hidden states (here: their sum)
    transformer = SD3Transformer2DModel(
        sample_size=IMAGE_SIZE // 2, patch_size=2, in_channels=4, out_channels=4, num_layers=layers,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=2 * hidden,
        caption_projection_dim=heads * head_dim, pooled_projection_dim=2 * hidden, pos_embed_max_size=32)
    vae = tiny_vae()
    # shift 1: the timestep shift SD3 uses at low resolution (3.0 is for 1024 px)
    return {"transformer": transformer, "scheduler": FlowMatchEulerDiscreteScheduler(shift=1.0), "vae": vae,
            "text_encoder": enc1, "tokenizer": tok, "text_encoder_2": enc2, "tokenizer_2": tok,
            "text_encoder_3": t5, "tokenizer_3": t5_tok}


def fit_vae(vae: Any, *, steps: int, seed: int = 0, batch: int = 16, lr: float = 2e-3) -> float:
    """Train ``vae`` as an autoencoder of the synthetic shapes scenes (reconstruction + a small KL term, as SD's
    VAE is trained): a random VAE decodes every latent to colour noise, so the images a pipeline draws would say
    nothing of what its transformer learned. Returns the last step's reconstruction MSE (pixels in [-1, 1])."""
    import random

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    vae.train()
    mse = float("nan")
    # minutes on a loaded CPU: a bar (or a line every 30 s off a terminal) with the step count and an ETA
    for _ in track(range(steps), steps, "fitting the VAE to the shapes scenes", "steps"):
        x = pil_pixels([draw(make_scene(rng), rng) for _ in range(batch)], CANVAS)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=gen)).sample
        loss = torch.nn.functional.mse_loss(rec, x)
        mse = float(loss.detach())
        (loss + 1e-6 * post.kl().mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    vae.eval()
    return mse


def build_tiny_sd3(out_dir: str | Path, size: str = "tiny", vocab_size: int | None = None, seed: int = 0,
                   vae_steps: int = 0) -> Path:
    """Build a random tiny SD3 pipeline and save it to ``out_dir`` (safetensors). With ``vae_steps`` its VAE is
    first fitted to the shapes scenes (:func:`fit_vae`). Returns ``out_dir``."""
    with quiet_diffusers():  # the pipeline's module names image processors that need torchvision
        from diffusers import StableDiffusion3Pipeline

    out = Path(out_dir)
    torch.manual_seed(seed)  # the weight init draws from the global generator
    pipe = StableDiffusion3Pipeline(**tiny_sd3_parts(size, vocab_size or VOCAB_SIZE))
    if vae_steps:
        fit_vae(pipe.vae, steps=vae_steps, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
