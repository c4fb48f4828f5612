"""Batched greedy / sampled generation from chat prompts (evaluation, demos, online rollouts)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from alignkit.errors import DataError
from alignkit.progress import track
from alignkit.rollout.engine import SamplingParams, sampling_kwargs


def prompt_text(tokenizer: Any, prompt: str | list[dict[str, str]]) -> str:
    """A prompt as the model sees it: chat template with the assistant turn opened, if there is one."""
    if getattr(tokenizer, "chat_template", None):
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if isinstance(prompt, list):
        raise DataError("message-list prompts need a tokenizer with a chat template")
    return prompt


@torch.no_grad()
def batched_generate(model: nn.Module, tokenizer: Any, n: int, encode: Callable[[int, int], Any], *,
                     max_new_tokens: int, batch_size: int, temperature: float = 0.0) -> list[str]:
    """Completions (special tokens stripped) of ``n`` prompts, in order: ``encode(start, stop)`` gives the model
    inputs of prompts ``start..stop-1`` (left-padded: the tokenizer pads left for the call); greedy when
    ``temperature`` is 0, else sampled. The model is in eval mode for the call and restored after."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    starts = range(0, n, batch_size)
    try:
        for i in track(starts, len(starts), "generating", "batches"):
            enc = encode(i, min(i + batch_size, n)).to(device)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, use_cache=True,
                                 **sampling_kwargs(SamplingParams(max_new_tokens, temperature)))
            out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return out


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompts: list[str | list[dict[str, str]]],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
) -> list[str]:
    """Completions (special tokens stripped) for each prompt, in order. Left-pads each batch."""
    texts = [prompt_text(tokenizer, p) for p in prompts]
    return batched_generate(model, tokenizer, len(prompts),
                            lambda a, b: tokenizer(texts[a:b], return_tensors="pt", padding=True, add_special_tokens=False),
                            max_new_tokens=max_new_tokens, batch_size=batch_size,
                            temperature=temperature if do_sample else 0.0)
