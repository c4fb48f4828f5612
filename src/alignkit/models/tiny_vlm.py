"""A tiny random LLaVA in Hugging Face format: small CLIP vision tower, the tiny Llama, projector, and a
processor (CLIP image processor + the tiny tokenizer with an ``<image>`` token + chat template).

``build_tiny_llava`` writes a directory that ``AutoProcessor.from_pretrained`` and
``LlavaForConditionalGeneration.from_pretrained`` (or ``AutoModelForImageTextToText``) load, like a
hub checkpoint. Images are 32x32 pixels cut into 8x8 patches: 16 image tokens per image (2x2 per
quadrant of the shapes task). Measured on that task (tests/integration/test_vlm_learning.py): 8x8 patches
learn shapes better than 4x4 (64 tokens the micro LM must combine) or 16x16 (one token per quadrant, which
the per-token projector must classify alone), and cost less than 4x4.

The random vision tower stands in for a pretrained one, whose patch features describe their own patch. A
random encoder layer does not: its near-uniform attention adds the image's mean to every patch, so which
colour and shape sit in which cell (what "What colour is the circle?" asks) is blurred before the LM sees
it. So each encoder layer starts as the identity (:func:`zero_residual_branches`, as in ReZero / Fixup):
the tower's output is its patch + position embeddings, and with ``vlm.train_vision_tower`` its layers
learn from there. Measured on the shapes task (micro LLaVA, seed 0, same recipe): colour + shape questions
0.84 with the random layers, 0.99 with identity layers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from alignkit.models.tiny_base import SIZES, _check_choice, tiny_config, train_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 8

#: The tiny tokenizer's ChatML, also for messages whose content is a list of parts ({"type": "image"} or
#: {"type": "text", "text": ...}): an image part becomes one ``<image>`` placeholder, which the processor
#: expands into one token per image patch.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>\n{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: vision tower shapes per LM size: (hidden, layers, heads, intermediate)
VISION_SIZES: dict[str, tuple[int, int, int, int]] = {
    "micro": (64, 2, 4, 128),
    "tiny": (64, 2, 4, 128),
    "small": (192, 4, 6, 384),
}


def zero_residual_branches(vision_tower: torch.nn.Module) -> int:
    """Zero the output projection of every encoder layer's attention (``out_proj``) and MLP (``fc2``), weights
    and biases, so each pre-norm residual layer computes the identity until it trains. Returns the number of
    tensors zeroed (CLIP and SigLIP towers name them alike)."""
    n = 0
    for name, p in vision_tower.named_parameters():
        if ".layers." in name and (".self_attn.out_proj." in name or ".mlp.fc2." in name):
            torch.nn.init.zeros_(p)
            n += 1
    return n


def tiny_vlm_tokenizer(vocab_size: int) -> object:
    """The tiny BPE tokenizer plus ``<image>`` as a special token (one id, never split)."""
    tok = train_tokenizer(vocab_size)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", IMAGE_TOKEN]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def build_tiny_llava(out_dir: str | Path, size: str = "tiny", vocab_size: int | None = None, seed: int = 0,
                     patch_size: int = PATCH_SIZE) -> Path:
    """Build and save a random LLaVA (``size`` picks the Llama, see ``tiny_base.SIZES``) and its processor.

    Deterministic: the same arguments give the same files. Returns ``out_dir``.
    """
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    _check_choice("size", size, SIZES)
    out = Path(out_dir)
    tokenizer = tiny_vlm_tokenizer(vocab_size or SIZES[size]["vocab_size"])
    text = tiny_config(tokenizer, size)
    hidden, layers, heads, inter = VISION_SIZES[size]
    vision = CLIPVisionConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                              num_attention_heads=heads, image_size=IMAGE_SIZE, patch_size=patch_size,
                              projection_dim=hidden)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         projector_hidden_act="gelu", tie_word_embeddings=False)
    torch.manual_seed(seed)  # the weight init draws from the global generator
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        zero_residual_branches(model.model.vision_tower)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    images = CLIPImageProcessorPil(  # PIL/numpy: needs no torchvision
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", chat_template=VLM_CHAT_TEMPLATE,
                               image_token=IMAGE_TOKEN, num_additional_image_tokens=1)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    return out
