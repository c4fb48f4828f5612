"""Batched generation from image + chat prompts with a LLaVA-family model (evaluation, demos).

The text twin is :func:`alignkit.rollout.generate.generate`; here the processor renders each prompt
(``<image>`` placeholders expanded to image tokens) and preprocesses its images into ``pixel_values``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from alignkit.progress import track


@torch.no_grad()
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
    images); the assistant turn is opened by the chat template. Left-pads each batch.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tok = processor.tokenizer
    old_side = tok.padding_side
    tok.padding_side = "left"
    out: list[str] = []
    starts = range(0, len(prompts), batch_size)
    try:
        for i in track(starts, len(starts), "generating", "batches"):
            texts = [tok.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True)
                     for p in prompts[i : i + batch_size]]
            flat = [img for imgs in images[i : i + batch_size] for img in imgs]
            enc = processor(text=texts, images=flat or None, padding=True, add_special_tokens=False,
                            return_tensors="pt").to(device)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, use_cache=True)
            out += tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tok.padding_side = old_side
        model.train(was_training)
    return out


def shapes_accuracy(model: nn.Module, processor: Any, rows: Sequence[dict[str, Any]], image_root: str,
                    *, batch_size: int = 64) -> dict[str, float]:
    """Exact-match accuracy of greedy answers to the shapes task's eval rows (one question each), per
    question kind and over all (:mod:`alignkit.data.synth_vlm` judges them from each row's scene)."""
    from pathlib import Path

    from alignkit.data.synth_vlm import judge, question_kind
    from alignkit.data.vlm import open_image

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
        hits.setdefault(question_kind(q), []).append(ok)
        hits.setdefault("all", []).append(ok)
    return {k: sum(v) / len(v) for k, v in hits.items()}
