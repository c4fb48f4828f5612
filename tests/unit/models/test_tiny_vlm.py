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


def test_tiny_tower_layers_start_as_the_identity_and_then_train(tmp_path: Path) -> None:
    """The random tower's encoder layers add nothing at first (its features are the patch + position
    embeddings, local to each patch), yet their output projections get gradients, so a trained tower
    (``vlm.train_vision_tower``) moves away from the identity after one step."""
    from transformers import LlavaForConditionalGeneration

    from alignkit.models.tiny_vlm import build_tiny_llava

    model = LlavaForConditionalGeneration.from_pretrained(build_tiny_llava(tmp_path / "m", size="micro"))
    tower = model.model.vision_tower
    pixels = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    hidden = tower(pixels, output_hidden_states=True).hidden_states
    assert len(hidden) == model.config.vision_config.num_hidden_layers + 1 > 2
    torch.testing.assert_close(hidden[-1], hidden[0], rtol=0, atol=0)
    assert hidden[0].std() > 0.5  # the embeddings themselves are not zero
    model.model.multi_modal_projector(hidden[-1][:, 1:]).pow(2).mean().backward()
    zeroed = [p for n, p in tower.named_parameters() if ".out_proj." in n or ".fc2." in n]
    assert zeroed and all(p.grad is not None and p.grad.abs().sum() > 0 for p in zeroed if p.ndim == 2)
    with torch.no_grad():
        for p in zeroed:
            p -= 0.1 * p.grad / p.grad.norm().clamp_min(1e-12)  # a fixed-length step along the gradient
        after = tower(pixels, output_hidden_states=True).hidden_states
    assert (after[-1] - after[0]).abs().max() > 1e-3
