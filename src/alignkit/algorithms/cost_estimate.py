"""The on-policy estimate of J_C for a cost constraint J_C <= d (Safe RLHF, ALGORITHMS 1.3 and 1.5
defect 6): the prompts' token ids as training encodes them, responses sampled from the policy and
scores of those responses by the frozen cost model, encoded exactly as training pairs are. The
multiplier it feeds is :class:`alignkit.algorithms.lagrange.Multiplier`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import TokenCollator
from alignkit.data.io import Row
from alignkit.data.preference import as_chat, encode_scored
from alignkit.data.safety import prompt_ids
from alignkit.data.tokenize import render_chat
from alignkit.data.vlm import RowImages, pixel_inputs
from alignkit.models.policy import model_inputs
from alignkit.rollout.engine import SamplingParams, sampling_kwargs


@dataclass
class EstimatePrompt:
    """A prompt of the on-policy cost estimate: the text or chat, and its image files (a VLM's rows)."""

    prompt: str | list[dict[str, str]]
    images: list[str] = field(default_factory=list)


def _row_images(processor: Any, p: EstimatePrompt) -> RowImages:
    return RowImages.read(processor, Row({}, "<cost prompts>", 0), p.images, None)


def prompt_inputs(tokenizer: Any, prompts: list[EstimatePrompt], *, chat_template: bool,
                  processor: Any = None) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """The prompts' token ids exactly as training encodes them before the response, and the image inputs
    (``pixel_values``, ...) of a vision-language model (its ``<image>`` tokens expanded)."""
    if processor is None:
        return [prompt_ids(tokenizer, p.prompt, chat_template=chat_template) for p in prompts], {}
    ids = []
    for p in prompts:
        images = _row_images(processor, p)
        chat = images.place(as_chat(p.prompt, "user"), Row({}, "<cost prompts>", 0))
        text = render_chat(tokenizer, chat, add_generation_prompt=True)
        ids.append(list(processor(text=[text], images=images.images or None, add_special_tokens=False)["input_ids"][0]))
    return ids, pixel_inputs(processor, [s for p in prompts for s in p.images])


@torch.no_grad()
def sample_responses(lm: nn.Module, tokenizer: Any, prompts: list[list[int]], *, max_new_tokens: int,
                     do_sample: bool, temperature: float, inputs: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Responses of the HF causal LM ``lm`` to token-id prompts (left-padded, one batch), special
    tokens stripped; ``inputs``: extra model inputs (a VLM's ``pixel_values``). ``lm`` is put in eval
    mode for the call and restored."""
    device = next(lm.parameters()).device
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    extra = {k: v.to(device) for k, v in (inputs or {}).items()}
    was_training = lm.training
    lm.eval()
    try:
        out = lm.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                          pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, use_cache=True, **extra,
                          **sampling_kwargs(SamplingParams(max_new_tokens, temperature if do_sample else 0.0)))
    finally:
        lm.train(was_training)
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


@torch.no_grad()
def score_responses(scorer: nn.Module, tokenizer: Any, prompts: list[Any], responses: list[str], *,
                    chat_template: bool, max_length: int, device: torch.device, processor: Any = None) -> torch.Tensor:
    """``(N,)`` scores of (prompt, response) sequences, encoded as the training pairs are. ``prompts``: texts /
    chats, or :class:`EstimatePrompt` s (with images for a vision-language ``processor``)."""
    seqs, sources = [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        est = p if isinstance(p, EstimatePrompt) else EstimatePrompt(p)
        images = _row_images(processor, est) if processor is not None else None
        ids = encode_scored(tokenizer, est.prompt, r, Row({}, "<generated>", i), max_length=max_length,
                            chat_template=chat_template, images=images)
        sources += images.sources if images is not None else []
        seqs.append({"input_ids": ids, "labels": [IGNORE_INDEX] * len(ids)})
    batch = TokenCollator(tokenizer.pad_token_id, packed=True)(seqs)
    if processor is not None:
        batch.add_inputs(pixel_inputs(processor, sources))
    batch = batch.to(device)
    return scorer(seq_index=batch["seq_index"], num_seqs=len(seqs), **model_inputs(batch)).float()


def prompt_share(n_prompts: int, total: int, estimate: int, rank: int, world: int) -> list[int]:
    """Indices (into ``n_prompts`` prompts) this rank generates for estimate number ``estimate``:
    ``ceil(total / world)`` per rank, every rank the same count (sharded engines gather in lockstep),
    walking through the prompt list so successive estimates see new prompts."""
    per_rank = max(1, math.ceil(total / world))
    start = estimate * per_rank * world + rank * per_rank
    return [(start + i) % n_prompts for i in range(per_rank)]
