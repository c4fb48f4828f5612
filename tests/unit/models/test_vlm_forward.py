"""A ``vlm`` model role: the same log-prob forward as a text LM, with ``pixel_values`` passed through
(``forward_logps`` forwards every model-input field of a batch), on a tiny random LLaVA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from alignkit.config.schema import ModelConfig
from alignkit.constants import IGNORE_INDEX
from alignkit.data.batch import Batch
from alignkit.models.policy import forward_logps
from alignkit.models.roles import ModelSpec, build_model

IMAGE_TOKEN = 99


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=128)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                      vision_feature_select_strategy="default", vision_feature_layer=-1)
    out = tmp_path_factory.mktemp("llava")
    LlavaForConditionalGeneration(cfg).save_pretrained(out)
    return out


def test_vlm_role_log_probs_equal_the_models_own_logits(tiny_llava: Path) -> None:
    model = build_model(ModelSpec("policy", str(tiny_llava), "vlm", trainable=True),
                        ModelConfig(name_or_path=str(tiny_llava)), torch.float32, None)
    model.eval()
    ids = torch.tensor([[1] + [IMAGE_TOKEN] * 16 + [5, 6, 7, 8, 9]])  # 16 patches of a 32x32 image, then text
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[0, 17:-1] = ids[0, 18:]  # loss on the text after the image only
    pixels = torch.randn(1, 3, 32, 32)
    inputs = {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}
    batch = Batch(inputs, {"targets": targets})
    with torch.no_grad():
        got = forward_logps(model, batch)
        logits = model.hf_model(input_ids=ids, pixel_values=pixels).logits[0]
        other = forward_logps(model, Batch({**inputs, "pixel_values": torch.randn(1, 3, 32, 32)}, {"targets": targets}))
    keep = targets[0] != IGNORE_INDEX
    want = F.log_softmax(logits[keep].double(), -1).gather(1, targets[0, keep][:, None]).squeeze(1).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - other).abs().max() > 1e-4  # the image really reaches the text tokens
