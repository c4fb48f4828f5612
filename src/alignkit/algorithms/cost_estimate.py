"""The Lagrange multiplier of a cost constraint J_C <= d, estimated on the policy's own samples
(Safe RLHF, ALGORITHMS 1.3 and 1.5 defect 6).

:class:`Multiplier` holds ln lambda and the window of recent sample costs; :meth:`Multiplier.update`
takes the costs of every rank's samples (the same list on every rank), lets rank 0 apply
``lagrange_update`` to the window mean and broadcasts rank 0's state, so every rank holds the same
lambda and window. :func:`sample_costs` generates responses for prompts from the policy (under
``strategy.full_params``) and scores them with the frozen cost model exactly as training pairs are
encoded.
"""

from __future__ import annotations

import math
from collections import deque
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
from alignkit.distributed import comm
from alignkit.losses.safe_dpo import lagrange_update
from alignkit.models.policy import model_inputs
from alignkit.rollout.engine import Prompt, SamplingParams, build_engine
from alignkit.rollout.vlm_generate import image_prompt


@dataclass
class Multiplier:
    """ln lambda, clamped above at ln lambda_max, and a window of the last ``window`` sample costs."""

    log_lambda: float
    threshold: float
    lr: float
    lambda_max: float
    window: int = 128
    costs: deque[float] = field(default_factory=deque)
    j_c: float | None = None  # mean of the window at the last update
    updates: int = 0

    @property
    def value(self) -> float:
        return math.exp(self.log_lambda)

    def update(self, costs: list[float]) -> None:
        """Add every rank's sample costs (identical on every rank), update on rank 0, broadcast."""
        if comm.rank() == 0:
            self.costs.extend(costs)
            while len(self.costs) > self.window:
                self.costs.popleft()
            self.j_c = sum(self.costs) / len(self.costs)
            self.log_lambda = lagrange_update(self.log_lambda, self.j_c, threshold=self.threshold, lr=self.lr,
                                              lam_max=self.lambda_max)
            self.updates += 1
        self.load_state_dict(comm.broadcast_object(self.state_dict(), src=0))

    def state_dict(self) -> dict[str, Any]:
        return {"log_lambda": self.log_lambda, "cost_window": list(self.costs), "J_C": self.j_c,
                "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.log_lambda = float(state["log_lambda"])
        self.costs = deque(float(c) for c in state["cost_window"])
        self.j_c = None if state["J_C"] is None else float(state["J_C"])
        self.updates = int(state["updates"])


@dataclass
class EstimatePrompt:
    """A prompt of the on-policy cost estimate: the text or chat, and its image files (a VLM's rows)."""

    prompt: str | list[dict[str, str]]
    images: list[str] = field(default_factory=list)


def _row_images(processor: Any, p: EstimatePrompt) -> RowImages:
    return RowImages.read(processor, Row({}, "<cost prompts>", 0), p.images, None)


def prompt_inputs(tokenizer: Any, prompts: list[EstimatePrompt], *, chat_template: bool,
                  processor: Any = None) -> list[Prompt]:
    """The engine requests of ``prompts``: token ids exactly as training encodes them before the response,
    and, for a vision-language model, each prompt's image inputs (its ``<image>`` tokens expanded)."""
    if processor is None:
        return [Prompt(prompt_ids(tokenizer, p.prompt, chat_template=chat_template)) for p in prompts]
    requests = []
    for p in prompts:
        images = _row_images(processor, p)
        chat = images.place(as_chat(p.prompt, "user"), Row({}, "<cost prompts>", 0))
        text = render_chat(tokenizer, chat, add_generation_prompt=True)
        requests.append(image_prompt(processor, text, images.images))
    return requests


def sample_responses(lm: nn.Module, tokenizer: Any, prompts: list[Prompt], *, max_new_tokens: int,
                     do_sample: bool, temperature: float) -> list[str]:
    """Responses of the HF causal LM ``lm`` (special tokens stripped) to the requests of
    :func:`prompt_inputs`, by the rollout engine in ONE batch: the batch split decides which random numbers
    each row's draws take, so one batch keeps a seeded estimate's samples what they were. ``lm`` is put in
    eval mode for the call and restored."""
    params = SamplingParams(max_new_tokens, temperature if do_sample else 0.0, batch_size=max(1, len(prompts)))
    return build_engine("hf", tokenizer).generate(lm, prompts, params).texts


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
        batch.update(pixel_inputs(processor, sources))
    batch = {k: v.to(device) for k, v in batch.items()}
    return scorer(seq_index=batch["seq_index"], num_seqs=len(seqs), **model_inputs(batch)).float()


def prompt_share(n_prompts: int, total: int, estimate: int, rank: int, world: int) -> list[int]:
    """Indices (into ``n_prompts`` prompts) this rank generates for estimate number ``estimate``:
    ``ceil(total / world)`` per rank, every rank the same count (sharded engines gather in lockstep),
    walking through the prompt list so successive estimates see new prompts."""
    per_rank = max(1, math.ceil(total / world))
    start = estimate * per_rank * world + rank * per_rank
    return [(start + i) % n_prompts for i in range(per_rank)]
