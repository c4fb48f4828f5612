"""What a token model kind's ``generate`` trades with a rollout engine, on the models floor.

A kind hands an engine :class:`Prompt` s and :class:`SamplingParams` and gets :class:`Generations` back; the
engine is whatever has :class:`TokenGenerator`'s ``generate`` (every ``rollout.engine.RolloutEngine`` does).
They live here, below the rollout, so the kinds (``models/kinds.py``) name them without importing the rollout
floor above them; ``alignkit.rollout.engine`` re-exports the three value types under the same names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 64  # sequences per generate call
    #: ask the engine for the sampler's log-prob of each completion token (``Generations.logps``) where it does not
    #: report them anyway: ``hf`` takes them off the decoding steps' own logits (a separate placement's
    #: generators, for stale samples' behaviour log-probs, instead of a forward of the completions)
    logprobs: bool = False


@dataclass(frozen=True)
class Prompt:
    """One generation request. ``ids``: the prompt's token ids as the model reads them (a VLM's image
    tokens already expanded, no padding); ``inputs``: its extra model inputs, each tensor's first dim
    indexing this prompt's images (``pixel_values`` ``(n_images, C, H, W)``); None for a text prompt.
    ``seed``: the request's own sampling stream (``rollout/seeds.py``): an engine draws this completion's random
    numbers from a generator seeded with it, so the same seed samples the same completion in any batch and on
    any process (vLLM: the request's ``seed``); None: the process's global generator."""

    ids: list[int]
    inputs: dict[str, torch.Tensor] | None = None
    seed: int | None = None


@dataclass
class Generations:
    """One completion per prompt, in order: ``completion_ids[i]`` (ending with EOS when the model stopped),
    ``finish_reasons[i]`` ("stop": EOS; "length": max_new_tokens reached first) and ``texts[i]`` (decoded,
    special tokens skipped); ``logps[i]``: the sampler's log-prob of each completion token where the engine
reports it (vLLM; for the importance-sampling correction), else None."""

    completion_ids: list[list[int]]
    finish_reasons: list[str]
    texts: list[str]
    logps: list[list[float]] | None = None

    @property
    def truncated(self) -> list[bool]:
        """Whether each completion was cut by max_new_tokens."""
        return [r == "length" for r in self.finish_reasons]


REPLACEMENT = "\ufffd"


def completion_texts(tokenizer: Any, completion_ids: list[list[int]]) -> list[str]:
    """Each completion decoded as one whole sequence (special tokens skipped), never token by token: a byte-level
    tokenizer spells a multi-byte character over several tokens, and a token alone decodes to U+FFFD. A character
    cut at the end (max_new_tokens reached in its middle) would still decode to U+FFFD: its 1-3 tokens are left
    out of the text (the ids keep them). A U+FFFD inside the text stays: the model wrote bytes that are no UTF-8."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True) if completion_ids else []
    return [_without_cut_character(tokenizer, ids, text) for ids, text in zip(completion_ids, texts)]


def _without_cut_character(tokenizer: Any, ids: list[int], text: str) -> str:
    """``text`` less a trailing partial character: the decode of ``ids`` less its last 1-3 tokens whose text the
    whole one continues with U+FFFD alone, or ``text`` unchanged."""
    if not text.endswith(REPLACEMENT):
        return text
    for cut in range(1, min(3, len(ids)) + 1):
        shorter = tokenizer.decode(ids[:-cut], skip_special_tokens=True)
        if not shorter.endswith(REPLACEMENT) and text.startswith(shorter) and not text[len(shorter):].strip(REPLACEMENT):
            return shorter
    return text


class TokenGenerator(Protocol):
    """What a token kind's ``generate`` calls on the run's engine (``rollout.engine.RolloutEngine`` has it)."""

    def generate(self, model: nn.Module, prompts: Sequence[Prompt] | Sequence[list[int]], params: SamplingParams,
                 *, synced: bool = False, progress: str | None = None) -> Generations:
        """One completion per prompt sampled from ``model`` under ``params``; ``synced``: the module is sharded
        and every rank steps together until all are done."""
