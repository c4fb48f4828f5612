"""Generation from image + chat prompts with a LLaVA-family model (evaluation, demos).

The text twin is :func:`alignkit.rollout.generate.generate`; here the processor renders each prompt
(``<image>`` placeholders expanded to image tokens) and preprocesses its images into ``pixel_values``
(:func:`image_prompt`), and the rollout engine pads, batches, generates and decodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from alignkit.config.schema import ModelConfig
from alignkit.data.synth_vlm import judge, question_kind
from alignkit.data.vlm import chat_and_images, open_image, resolve_image
from alignkit.errors import DataError
from alignkit.models.adapter_dirs import adapter_base, is_adapter_dir
from alignkit.models.sources import model_errors
from alignkit.models.vlm import load_vlm_model
from alignkit.rollout.engine import Prompt, SamplingParams, build_engine, generate_once

#: processor outputs with one entry per token, not per image: the engine pads and masks the ids itself
_PER_TOKEN = ("input_ids", "attention_mask", "token_type_ids")


def image_prompt(processor: Any, text: str, images: Sequence[Any]) -> Prompt:
    """The engine request of one rendered prompt ``text`` (one ``<image>`` per image) and its PIL
    ``images``: the processor's ids (image tokens expanded) and image inputs (``pixel_values``
    ``(len(images), C, H, W)``; none for a prompt without images)."""
    enc = processor(text=[text], images=list(images) or None, add_special_tokens=False, return_tensors="pt")
    inputs = {k: v for k, v in enc.items() if k not in _PER_TOKEN and isinstance(v, torch.Tensor)}
    return Prompt(enc["input_ids"][0].tolist(), inputs or None)


def generate_with_images(
    model: nn.Module,
    processor: Any,
    prompts: Sequence[list[dict[str, str]]],
    images: Sequence[Sequence[Any]],
    *,
    max_new_tokens: int = 16,
    batch_size: int = 32,
) -> list[str]:
    """Greedy completions (special tokens stripped), in order.

    ``prompts[i]``: a chat whose string contents hold one ``<image>`` per image of ``images[i]`` (PIL
    images); the assistant turn is opened by the chat template. The engine left-pads each batch.
    """
    tok = processor.tokenizer
    requests = [image_prompt(processor, tok.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True),
                             imgs) for p, imgs in zip(prompts, images)]
    params = SamplingParams(max_new_tokens, 0.0, batch_size=batch_size)
    return generate_once(build_engine("hf", tok), model, requests, params, progress="generating").texts


def shapes_accuracy(model: nn.Module, processor: Any, rows: Sequence[dict[str, Any]], image_root: str,
                    *, batch_size: int = 64) -> dict[str, float]:
    """Exact-match accuracy of greedy answers to the shapes task's eval rows (one question each), per
    question kind, over colour + shape questions (``colour_shape``) and over all (:mod:`alignkit.data.synth_vlm`
    judges them from each row's scene)."""
    prompts, images, questions = [], [], []
    for r in rows:
        q = r["conversations"][0]["value"]
        prompts.append([{"role": "user", "content": q}])
        images.append([open_image(str(Path(image_root) / r["image"]))])
        questions.append(q)
    answers = generate_with_images(model, processor, prompts, images, batch_size=batch_size)
    hits: dict[str, list[bool]] = {}
    for r, q, a in zip(rows, questions, answers):
        ok = judge(r["scene"], q, a)
        kind = question_kind(q)
        hits.setdefault(kind, []).append(ok)
        hits.setdefault("all", []).append(ok)
        if kind in ("colour", "shape"):  # the measure: colour and shape questions together
            hits.setdefault("colour_shape", []).append(ok)
    return {k: sum(v) / len(v) for k, v in hits.items()}


def image_prompts(rows: Sequence[Any], image_root: str | None) -> tuple[list[list[dict[str, str]]], list[list[Any]]]:
    """Prompts and images of image-text rows (:mod:`alignkit.data.vlm` formats): each chat up to its last
    user turn (a trailing assistant answer is dropped), its images read (a bad one names the row)."""
    prompts, images = [], []
    for row in rows:
        messages, refs = chat_and_images(row)
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise DataError(f"{row.where()}: no user turn to answer")
        prompts.append(messages)
        images.append([open_image(resolve_image(r, row, image_root), row.where("image")) for r in refs])
    return prompts, images


def load_vlm_for_generation(model_dir: str) -> tuple[nn.Module, Any]:
    """A LLaVA-family model (full or LoRA adapter directory) and its processor, frozen."""
    from transformers import AutoProcessor

    with model_errors(model_dir):
        model = load_vlm_model(ModelConfig(name_or_path=model_dir), model_dir, torch.float32, trainable=False)
        src = model_dir
        if is_adapter_dir(model_dir) and not (Path(model_dir) / "processor_config.json").is_file():
            src = adapter_base(model_dir)
        processor = AutoProcessor.from_pretrained(src)
    model.eval().requires_grad_(False)
    return model, processor
