"""``alignkit tiny-model OUT --arch llava``: a tiny LLaVA whose directory transformers' own classes load
(``AutoProcessor``, ``LlavaForConditionalGeneration``), with an ``<image>`` token expanded per patch."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from alignkit.cli import main
from alignkit.models.tiny_vlm import IMAGE_SIZE, PATCH_SIZE


def test_tiny_llava_loads_in_transformers_and_sees_the_image(tmp_path: Path) -> None:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    assert main(["tiny-model", str(tmp_path / "m"), "--arch", "llava", "--size", "micro"]) == 0
    processor = AutoProcessor.from_pretrained(tmp_path / "m")
    model = LlavaForConditionalGeneration.from_pretrained(tmp_path / "m").eval()
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\n<image>\nWhat colour") and text.endswith("<|im_start|>assistant\n")
    red, blue = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 0, 0)), Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 255))
    enc = processor(text=[text, text], images=[red, blue], return_tensors="pt")
    n_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    assert int((enc["input_ids"][0] == model.config.image_token_id).sum()) == n_patches
    assert enc["pixel_values"].shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape[-1] == len(processor.tokenizer)
    assert (logits[0, -1] - logits[1, -1]).abs().max() > 1e-4  # the two images give different next-token logits
