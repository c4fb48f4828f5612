"""The generation value types and the trained-model Handle live on the models floor (models/generation.py,
models/handle.py); the engines and the Strategy re-export them under their old names, and a token kind's
``generate`` needs of an engine only :class:`TokenGenerator`'s ``generate``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from alignkit.distributed.strategy import base as strategy_base
from alignkit.models import generation, handle
from alignkit.models.kinds import KINDS
from alignkit.models.roles import Models
from alignkit.rollout import engine


def test_engine_and_strategy_re_export_the_same_types() -> None:
    assert engine.Generations is generation.Generations
    assert engine.Prompt is generation.Prompt
    assert engine.SamplingParams is generation.SamplingParams
    assert strategy_base.Handle is handle.Handle


class RecordingGenerator:
    """A TokenGenerator that is no RolloutEngine: it answers each prompt with its own reversed ids."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module, int, generation.SamplingParams, bool]] = []

    def generate(self, model: nn.Module, prompts: Sequence[generation.Prompt] | Sequence[list[int]],
                 params: generation.SamplingParams, *, synced: bool = False,
                 progress: str | None = None) -> generation.Generations:
        self.calls.append((model, len(prompts), params, synced))
        ids = [list(reversed(p.ids if isinstance(p, generation.Prompt) else p)) for p in prompts]
        return generation.Generations(ids, ["stop"] * len(ids), [str(i) for i in ids])


class Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.hf_model = inner


def test_the_lm_kind_generates_through_any_token_generator() -> None:
    inner = nn.Linear(2, 2)
    gen = RecordingGenerator()
    params = generation.SamplingParams(max_new_tokens=3, temperature=0.0)
    prompts: list[Any] = [generation.Prompt([1, 2, 3]), [4, 5]]
    out = KINDS.get("lm").generate(Wrapped(inner), gen, prompts, params, synced=True)
    assert out.completion_ids == [[3, 2, 1], [5, 4]]
    assert gen.calls == [(inner, 2, params, True)]  # the unwrapped module, the params and synced passed through


def test_a_handle_is_the_models_bundles_record() -> None:
    module = nn.Linear(1, 1)
    h = handle.Handle("policy", module, torch.optim.SGD(module.parameters(), lr=0.1))
    models = Models({"policy": h})
    assert models["policy"] is module and models.primary == "policy" and h.sync and h.scaler is None
