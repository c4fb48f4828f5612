"""Generation from text / chat prompts (evaluation, the demo, ``alignkit generate``): the prompts rendered
and tokenised here, then the rollout engine (:mod:`alignkit.rollout.engine`) pads, generates and decodes,
as it does for online rollouts."""

from __future__ import annotations

from typing import Any

from torch import nn

from alignkit.data.prompts import prompt_text
from alignkit.rollout.engine import SamplingParams, build_engine, generate_once


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompts: list[str | list[dict[str, str]]],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    engine: str = "hf",
) -> list[str]:
    """Completions (special tokens stripped) for each prompt, in order: greedy, or sampled at
    ``temperature`` with ``do_sample``, by the rollout engine ``engine``. The model is in eval mode for the call
    and restored after."""
    if not prompts:
        return []
    texts = [prompt_text(tokenizer, p) for p in prompts]
    # the template already holds the special tokens; each text alone gives the ids a padded batch holds
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens, temperature if do_sample else 0.0, batch_size=batch_size)
    return generate_once(build_engine(engine, tokenizer), model, ids, params, progress="generating").texts
