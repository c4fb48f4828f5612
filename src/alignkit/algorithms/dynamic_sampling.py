"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2) as a part of the group-relative rollout: a group whose
rewards all agree (zero std: every completion right, or every one wrong) has zero advantages and trains nothing,
so it is dropped and the iteration's batch is refilled with the groups of fresh prompts (the next ones of the
run's prompt order, consumed as any iteration's), generating up to ``grpo.max_sampling_rounds`` extra rounds.

Every rank decides from the rewards gathered in global order, so all take the same rounds and the same groups;
the batch keeps its shape: the first P groups with a spread (P = the iteration's prompts), in round order, and
when the rounds run out before P are found, the dropped groups fill the rest in the same order (zero advantages:
no gradient, counted). The chosen completions of every rank are exchanged as objects (``comm.all_gather_object``;
a group may span ranks), then each rank keeps its own slice. Logged: ``dynamic/groups_dropped`` (zero-spread
groups seen), ``dynamic/generation_rounds``, ``dynamic/groups_zero_std_kept`` (fillers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from alignkit.distributed import comm
from alignkit.metrics import MetricSums
from alignkit.rollout.advantages import group_nanstd
from alignkit.rollout.context import RolloutContext
from alignkit.rollout.engine import Generations


def has_spread(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(P,)`` bool: the groups of ``(P * G,)`` rewards whose std is above 0 (NaN: fewer than two scored, no spread)."""
    std = group_nanstd(rewards, group_size)
    return torch.nan_to_num(std, nan=0.0) > 1e-6


def select_groups(rounds: list[torch.Tensor], group_size: int, needed: int) -> tuple[list[tuple[int, int]], int]:
    """The ``needed`` groups a batch keeps from the gathered rewards of each round (``(P * G,)`` each), as
    (round, group) pairs: those with a spread in round order, then, if too few, the zero-spread ones in the same
    order; and how many of the chosen have no spread."""
    spread = [(r, g) for r, rewards in enumerate(rounds) for g, ok in enumerate(has_spread(rewards, group_size).tolist()) if ok]
    flat = [(r, g) for r, rewards in enumerate(rounds) for g in range(rewards.numel() // group_size)]
    chosen = spread[:needed]
    fillers = [x for x in flat if x not in set(spread)][: needed - len(chosen)]
    return sorted(chosen + fillers), len(fillers)


class Round:
    """One generation round's global view: every rank's (sample, row, text, finish reason), and the gathered scores."""

    def __init__(self, items: list[tuple[Any, ...]], scores: dict[str, torch.Tensor]) -> None:
        self.items, self.scores = items, scores


def draw_round(algo: Any, ctx: RolloutContext) -> Round:
    """Generate and score ``ctx.rows`` as the default rollout does; gather this rank's items into the global order."""
    gens = ctx.generate("policy", [row["prompt_ids"] for row in ctx.rows])
    samples = ctx.samples(gens.completion_ids)
    algo.tokens.mask_truncated(samples, gens.truncated)
    algo.tokens.keep_sampler_logps(samples, gens)
    scores = ctx.score(algo.signals(), ctx.score_inputs(samples, gens.texts))
    local = list(zip(samples, ctx.rows, gens.texts, gens.finish_reasons))
    return Round([x for part in comm.all_gather_object(local) for x in part], scores)


def dynamic_rollout(algo: Any, ctx: RolloutContext, group_size: int, max_rounds: int) -> tuple[
        RolloutContext, list[Any], Generations, dict[str, torch.Tensor], MetricSums]:
    """Rounds until the batch has its groups with a spread (or ``max_rounds`` extra ones were drawn): this rank's
    context over the chosen rows, its samples and generations, the chosen groups' gathered scores, and the counts."""
    needed = len(ctx.rows) * comm.world_size() // group_size  # every rank holds the same number of completions
    rounds, spread = [draw_round(algo, ctx)], []
    while True:
        spread = [int(has_spread(r.scores["reward"], group_size).sum()) for r in rounds]  # host-side, same on all ranks
        if sum(spread) >= needed or len(rounds) > max_rounds or ctx.refill is None:
            break
        rows, seeds = ctx.refill()
        rounds.append(draw_round(algo, dataclasses.replace(ctx, rows=rows, seeds=seeds)))
    chosen, fillers = select_groups([r.scores["reward"] for r in rounds], group_size, needed)
    index = [(r, g * group_size + j) for r, g in chosen for j in range(group_size)]
    mine = [rounds[r].items[i] for r, i in index][ctx.mine]
    scores = {k: torch.stack([rounds[r].scores[k][i] for r, i in index]) for k in rounds[0].scores}
    stats = MetricSums()
    stats.add("dynamic/groups_dropped", float(len(rounds) * needed - sum(spread)), 1)
    stats.add("dynamic/generation_rounds", float(len(rounds)), 1)
    stats.add("dynamic/groups_zero_std_kept", float(fillers), 1)
    gens = Generations([x[0]["completion_ids"] for x in mine], [x[3] for x in mine], [x[2] for x in mine])
    return dataclasses.replace(ctx, rows=[x[1] for x in mine]), [x[0] for x in mine], gens, scores, stats
