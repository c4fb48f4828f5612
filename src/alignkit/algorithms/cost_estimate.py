"""The on-policy estimate of J_C for a cost constraint J_C <= d (Safe RLHF, ALGORITHMS 1.3 and 1.5
defect 6): the prompts' token ids as training encodes them, responses sampled from the policy and
scores of those responses by the frozen cost model (``alignkit.rewards.scalar.score_responses``: encoded exactly
as training pairs are). The multiplier it feeds is :class:`alignkit.algorithms.lagrange.Multiplier`.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from alignkit.data.io import Row
from alignkit.data.preference import as_chat
from alignkit.data.safety import prompt_ids
from alignkit.data.tokenize import render_chat
from alignkit.rewards.scalar import EstimatePrompt, prompt_images
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.engine import Prompt, RolloutEngine, SamplingParams, build_engine, generate_once
from alignkit.rollout.vlm_generate import image_prompt


def prompt_inputs(tokenizer: Any, prompts: list[EstimatePrompt], *, chat_template: bool,
                  processor: Any = None) -> list[Prompt]:
    """The engine requests of ``prompts``: token ids exactly as training encodes them before the response,
    and, for a vision-language model, each prompt's image inputs (its ``<image>`` tokens expanded)."""
    if processor is None:
        return [Prompt(prompt_ids(tokenizer, p.prompt, chat_template=chat_template)) for p in prompts]
    requests = []
    for p in prompts:
        images = prompt_images(processor, p)
        chat = images.place(as_chat(p.prompt, "user"), Row({}, "<cost prompts>", 0))
        text = render_chat(tokenizer, chat, add_generation_prompt=True)
        requests.append(image_prompt(processor, text, images.images))
    return requests


def estimate_engine(cfg: Any, tokenizer: Any, max_new_tokens: int) -> RolloutEngine:
    """The run's rollout engine (``rollout.engine``, built from its settings) for the estimate's responses of up to
    ``max_new_tokens``."""
    return build_engine(cfg.section(RolloutConfig).engine, tokenizer, cfg, max_new_tokens=max_new_tokens)


def sample_responses(lm: nn.Module, engine: RolloutEngine, prompts: list[Prompt], *, max_new_tokens: int,
                     do_sample: bool, temperature: float) -> list[str]:
    """Responses of the HF causal LM ``lm`` (special tokens stripped) to the requests of :func:`prompt_inputs`, by
    ``engine`` (:func:`estimate_engine`) in ONE batch and one generation phase: the batch split decides which random
    numbers each row's draws take, so one batch keeps a seeded estimate's samples what they were. ``lm`` is put in
    eval mode for the call and restored."""
    params = SamplingParams(max_new_tokens, temperature if do_sample else 0.0, batch_size=max(1, len(prompts)))
    return generate_once(engine, lm, prompts, params).texts


def prompt_share(n_prompts: int, total: int, estimate: int, rank: int, world: int) -> list[int]:
    """Indices (into ``n_prompts`` prompts) this rank generates for estimate number ``estimate``:
    ``ceil(total / world)`` per rank, every rank the same count (sharded engines gather in lockstep),
    walking through the prompt list so successive estimates see new prompts."""
    per_rank = max(1, math.ceil(total / world))
    start = estimate * per_rank * world + rank * per_rank
    return [(start + i) % n_prompts for i in range(per_rank)]
