"""Scoring one iteration's completions: reward (or cost) functions, a trained scalar model, a length
penalty; then gathering the scores of every rank in global order.

``placement: local``: each rank scores its own samples. ``placement: main``: the prompts, completions
and row fields of every rank are gathered to rank 0, scored there (one call of each function over
the whole iteration, e.g. a judge that batches), and each rank receives the scores of ITS OWN samples
(the seed's broadcast of rank 0's scores to every rank is the bug this avoids). A trained reward or
cost model always scores locally: every rank holds it (under ``rollout.placement: separate`` the generators hold it
and score, and send its part with the completions: ``Signal.score``'s ``functions``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from alignkit.distributed import comm
from alignkit.errors import DataError, ModelError, UserError
from alignkit.models.roles import Models, same_vocabulary
from alignkit.rewards.functions import RewardFunctionError, WeightedFunction, by_field, call, combine, resolve
from alignkit.rewards.scalar import score_responses


@dataclass
class ScoreInputs:
    """This rank's samples: prompts as written, completion texts and token counts, row fields, and the
    collated micro-batches of (prompt + completion) for a scalar model (on the device)."""

    prompts: list[Any]
    completions: list[str]
    lengths: list[int]
    fields: list[dict[str, Any]]
    batches: Sequence[dict[str, torch.Tensor]]  # a list, or LazyBatches (collated on first use)


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's overlong soft punishment (Yu et al. 2025, eq. 13), added to a completion's reward: 0 up to
    ``max_new_tokens - buffer`` tokens, then linear down to ``-penalty`` at ``max_new_tokens`` (and beyond)."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)


class Signal:
    """One signal (``reward`` or ``cost``): weighted functions + an optional model role + a length penalty."""

    def __init__(self, signal: str, functions: Sequence[Any], *, model_role: str | None = None, model_weight: float = 1.0,
                 length_penalty: float = 0.0, max_new_tokens: int = 1, placement: str = "local",
                 chat_template: bool = True, max_length: int = 512) -> None:
        self.signal = signal
        self.functions = [WeightedFunction(f.name, f.weight, resolve(f.name)) for f in functions]
        self.model_role, self.model_weight = model_role, model_weight
        self.length_penalty, self.max_new_tokens, self.placement = length_penalty, max_new_tokens, placement
        #: how a scorer with a vocabulary of its own re-encodes (prompt, completion) text: as training did
        self.chat_template, self.max_length = chat_template, max_length
        #: DAPO's overlong soft punishment (:func:`overlong_penalty`): (buffer in tokens, penalty); buffer 0 = off
        self.overlong: tuple[int, float] = (0, 0.0)

    @property
    def components(self) -> list[str]:
        return [f.name for f in self.functions] + (["model"] if self.model_role else [])

    def score(self, models: Models, inputs: ScoreInputs, strategy: Any, *, placement: str | None = None,
              functions: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
        """Per component (function name, ``model``) this rank's scores, and ``total`` (NaN = masked).
        ``placement`` (``local`` | ``main``) overrides the scorer's own for this call (evaluation runs
        locally: ranks may hold different counts there). ``functions``: the parts computed already where the
        completions were generated (a separate placement's generators: every function's, and ``model`` where
        they hold the model role); the model where not among them, the weights and the penalties are applied here
        all the same."""
        parts = dict(functions) if functions is not None else self.function_scores(inputs, placement)
        expected = sorted(f.name for f in self.functions) + (["model"] if self.model_role and "model" in parts else [])
        if functions is not None and (sorted(parts) != sorted(expected) or any(
                len(v) != len(inputs.completions) for v in parts.values())):
            raise RuntimeError(f"{self.signal}: scores received for {sorted(parts)} of "
                               f"{[len(v) for v in parts.values()]} completions, expected the functions "
                               f"{sorted(f.name for f in self.functions)} of {len(inputs.completions)}")
        if self.model_role and "model" not in parts:
            parts["model"] = self._model_scores(models, inputs, strategy)
        weights = {f.name: f.weight for f in self.functions} | {"model": self.model_weight}
        total = combine(parts, weights) if parts else [0.0] * len(inputs.completions)
        if self.length_penalty:
            total = [t - self.length_penalty * n / self.max_new_tokens for t, n in zip(total, inputs.lengths)]
        if self.overlong[0]:
            total = [t + overlong_penalty(n, self.max_new_tokens, *self.overlong) for t, n in zip(total, inputs.lengths)]
        parts["total"] = total
        return parts

    def function_scores(self, inputs: ScoreInputs, placement: str | None = None) -> dict[str, list[float]]:
        """Each reward / cost function's scores of ``inputs`` (by name; none without functions): the part of
        :meth:`score` that needs no model, so it runs wherever the completions are (``placement`` as there)."""
        placement = placement or self.placement
        if not self.functions:
            return {}
        if placement == "main" and comm.world_size() > 1:
            return self._on_main(inputs)
        return {f.name: call(f, inputs.prompts, inputs.completions, by_field(inputs.fields)) for f in self.functions}

    def _on_main(self, inputs: ScoreInputs) -> dict[str, list[float]]:
        def compute(items: list[tuple[Any, str, dict[str, Any]]]) -> dict[str, list[float]]:
            prompts, completions, fields = [p for p, _, _ in items], [c for _, c, _ in items], [f for *_, f in items]
            return {f.name: call(f, prompts, completions, by_field(fields)) for f in self.functions}

        return on_main(compute, list(zip(inputs.prompts, inputs.completions, inputs.fields)))

    @torch.no_grad()
    def _model_scores(self, models: Models, inputs: ScoreInputs, strategy: Any) -> list[float]:
        """The model role's scores: of the policy's token ids where its vocabulary is the policy's, else of
        the decoded prompts and completions re-encoded with its own tokenizer."""
        role = self.model_role
        assert role is not None
        mine, policy = models.tokenizer(role), models.tokenizer("policy")
        if mine is None or policy is None or same_vocabulary(mine, policy):
            out: list[float] = []
            for batch in inputs.batches:
                with strategy.autocast():
                    out += models.scores(role, batch).float().cpu().tolist()
            return out

        try:
            with strategy.autocast():
                scores = score_responses(models[role], mine, inputs.prompts, inputs.completions,
                                         chat_template=self.chat_template, max_length=self.max_length,
                                         device=strategy.device)
        except (DataError, ValueError) as e:
            source = models.specs[role].source if role in models.specs else role
            raise ModelError(f"{self.signal} model {source}: its tokenizer differs from the policy's and the "
                             f"completions could not be re-encoded with it ({e})") from None
        return scores.cpu().tolist()


def on_main(compute: Callable[[list[Any]], dict[str, list[float]]], items: list[Any]) -> dict[str, list[float]]:
    """``compute`` run on rank 0 ALONE over the ``items`` of every rank (gathered in rank order; ranks may hold
    different counts), each rank receiving the values of ITS OWN items: its slice of every list ``compute``
    returns (one value per item). Never rank 0's values for other ranks' items (the seed guide's broadcast).
    A :class:`~alignkit.errors.UserError` raised by ``compute`` (a function's bad output, a scorer model that
    cannot load) is raised on every rank, or the others would wait forever. In one process: ``compute(items)``."""
    if comm.world_size() == 1:
        return compute(items)
    shares = comm.all_gather_object(items)
    scored: list[dict[str, list[float]]] | tuple[str, str] | None = None
    if comm.rank() == 0:
        try:
            whole = compute([x for share in shares for x in share])
        except UserError as e:  # every rank must learn of it
            scored = (type(e).__name__, str(e))
        else:
            scored, start = [], 0
            for share in shares:  # each rank's slice, in rank order
                scored.append({k: list(v[start : start + len(share)]) for k, v in whole.items()})
                start += len(share)
    scored = comm.broadcast_object(scored)
    if isinstance(scored, tuple):
        error = RewardFunctionError(scored[1]) if scored[0] == "RewardFunctionError" else UserError(scored[1])
        error.same_on_every_rank = True
        raise error
    return scored[comm.rank()]


def gather_scores(local: dict[str, list[float]]) -> dict[str, torch.Tensor]:
    """Every component's scores of every rank, concatenated in rank order (``(global,)`` float64)."""
    names = sorted(local)
    mat = torch.tensor([local[n] for n in names], dtype=torch.float64).T.contiguous()  # (n_local, K)
    whole = comm.all_gather_tensor(mat)
    return {n: whole[:, i] for i, n in enumerate(names)}


def nan_stats(values: torch.Tensor) -> tuple[float, float, int]:
    """(mean, std, count) of the non-NaN values; NaN mean/std when none."""
    ok = values[~torch.isnan(values)]
    if ok.numel() == 0:
        return math.nan, math.nan, 0
    std = float(ok.std()) if ok.numel() > 1 else 0.0
    return float(ok.mean()), std, int(ok.numel())
