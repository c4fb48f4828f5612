"""Scores of (prompt, response) pairs by a reward or cost model alignkit trained: the scalar head at each
sequence's last token, the pairs encoded exactly as the training pairs were (Safe-MM-DPO's J_C estimate, an
online scorer whose vocabulary differs from the policy's, the red-team ``reward_model`` / ``cost_model``
scorers, ``alignkit score``: ``cli/score_command.py``). With a vision-language model, prompts' images go in
with their prompt, as in training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from alignkit.config.loader import read_yaml
from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import TokenCollator
from alignkit.data.io import Row
from alignkit.data.preference import encode_scored
from alignkit.data.vlm import RowImages, pixel_inputs
from alignkit.models.policy import model_inputs


@dataclass
class EstimatePrompt:
    """A prompt of the on-policy cost estimate: the text or chat, and its image files (a VLM's rows)."""

    prompt: str | list[dict[str, str]]
    images: list[str] = dataclasses.field(default_factory=list)


def prompt_images(processor: Any, p: EstimatePrompt) -> RowImages:
    """The images of ``p`` read and preprocessed as training rows' are (a bad file names the prompt)."""
    return RowImages.read(processor, Row({}, "<cost prompts>", 0), p.images, None)


@torch.no_grad()
def score_responses(scorer: nn.Module, tokenizer: Any, prompts: list[Any], responses: list[str], *,
                    chat_template: bool, max_length: int, device: torch.device, processor: Any = None) -> torch.Tensor:
    """``(N,)`` scores of (prompt, response) sequences, encoded as the training pairs are. ``prompts``: texts /
    chats, or :class:`EstimatePrompt` s (with images for a vision-language ``processor``)."""
    seqs, sources = [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        est = p if isinstance(p, EstimatePrompt) else EstimatePrompt(p)
        images = prompt_images(processor, est) if processor is not None else None
        ids = encode_scored(tokenizer, est.prompt, r, Row({}, "<generated>", i), max_length=max_length,
                            chat_template=chat_template, images=images)
        sources += images.sources if images is not None else []
        seqs.append({"input_ids": ids, "labels": [IGNORE_INDEX] * len(ids)})
    batch = TokenCollator(tokenizer.pad_token_id, packed=True)(seqs)
    if processor is not None:
        batch.add_inputs(pixel_inputs(processor, sources))
    batch = batch.to(device)
    return scorer(seq_index=batch["seq_index"], num_seqs=len(seqs), **model_inputs(batch)).float()


def trained_format(model_dir: str | Path) -> dict[str, Any]:
    """``{"chat_template": bool, "max_length": int}`` the model was trained with, read from the
    ``config.yaml`` alignkit writes beside every final model and checkpoint; ``{}`` when absent
    (a model trained elsewhere)."""
    path = Path(model_dir) / "config.yaml"
    if not path.is_file():
        return {}
    data = read_yaml(path).get("data") or {}
    return {k: data[k] for k in ("chat_template", "max_length") if data.get(k) is not None}
