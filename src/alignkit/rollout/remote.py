"""The trainer's side of ``rollout.placement: separate``: completions the generator processes sampled, behind the
one engine interface, and the staleness bookkeeping of the samples made from them.

A trainer's rollout runs the algorithm's own ``rollout`` unchanged (ARCHITECTURE 7c): its ``ctx.generate`` reaches
:class:`RemoteEngine`, whose ``sync_weights`` sends the trainer's weights to the generators (trainer rank 0; the
others have nothing to send) and whose ``generate`` receives this rank's completions from every generator
(``train/generator_loop.py`` sends them), checking that they answer exactly the requests asked (the same rows and
per-completion seeds, ``rollout/seeds.py``). The scores the generators computed (reward functions and models) come with them
(:meth:`RemoteEngine.scored`, read by ``RolloutContext.score``); an algorithm whose generators make items of their
own (``grpo_agent``'s trajectories) takes them by :meth:`RemoteEngine.delivered`. What the generators report beside
them (the policy version that sampled, their idle and sync seconds) is kept on the engine for the loop to log.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
from torch import nn

from alignkit.distributed import comm
from alignkit.distributed.placement import (
    Gather,
    Placement,
    as_is,
    check_base,
    frozen_tensors,
    push_weights,
    recv_object,
    sync_tensors,
)
from alignkit.metrics import MetricSums
from alignkit.rollout.engine import Generations, Prompt, RolloutEngine, SamplingParams, as_prompts
from alignkit.rollout.experience import Sample


@dataclass
class Delivery:
    """What one generator sends one trainer for one iteration: the completions of the trainer's rows that the
    generator sampled (``seeds`` name them), the policy ``version`` that sampled them and the generator's
    seconds (``idle_s``: waiting for weights; ``generate_s``)."""

    iteration: int
    version: int
    seeds: list[int]
    completion_ids: list[list[int]]
    finish_reasons: list[str]
    texts: list[str]
    logps: list[list[float]] | None
    idle_s: float = 0.0
    generate_s: float = 0.0
    #: signal -> function name -> the functions' scores of the completions, computed by the generator
    scores: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    #: what an algorithm's own split rollout made of the rows instead (``grpo_agent``: finished trajectories);
    #: ``completion_ids`` etc. are then empty
    items: list[Any] | None = None
    #: the generator's seconds by phase (``score``; an agent's ``generate``, ``env`` and ``render``)
    seconds: dict[str, float] = field(default_factory=dict)
    #: the generator's global rank when a reward / cost MODEL scored the completions there (their ``model`` part
    #: is in ``scores``), else -1
    scored_by: int = -1
    #: the generator's seconds of this iteration by phase, logged as ``async/generator_<phase>_s``: ``sample`` (the
    #: engine), ``behaviour_logps`` (a forward where the engine reported none), ``score``, ``send`` (the previous
    #: delivery's pickling); an agent's ``env`` and ``render`` too
    phases: dict[str, float] = field(default_factory=dict)

    def part(self, cut: slice) -> Delivery:
        """The delivery of the rows at ``cut`` (one trainer's part of a generator's share)."""
        def rows(values: list[Any] | None) -> Any:
            return None if values is None else values[cut]

        return replace(self, seeds=self.seeds[cut], completion_ids=self.completion_ids[cut],
                       finish_reasons=self.finish_reasons[cut], texts=self.texts[cut], logps=rows(self.logps),
                       scores={n: {f: v[cut] for f, v in by_fn.items()} for n, by_fn in self.scores.items()},
                       items=rows(self.items))


@dataclass
class Received:
    """The last iteration's deliveries in words the loop logs: the version of each completion, the generators'
    idle and generation seconds (max over generators), this trainer's seconds waiting and pushing weights."""

    versions: list[int] = field(default_factory=list)
    logps: list[list[float]] | None = None
    generator_idle_s: float = 0.0
    generator_generate_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    sync_bytes: int = 0
    #: the highest global rank of a generator whose reward / cost model scored these completions (-1: none did)
    scored_by: int = -1
    #: the generators' seconds by phase (``Delivery.phases``; the largest of them)
    generator_phases: dict[str, float] = field(default_factory=dict)


class RemoteEngine(RolloutEngine):
    """A trainer's engine under ``placement: separate`` (module docstring). ``parts``: for each generator (global
    rank), whether it holds some of this trainer's completions each iteration (it sends them in generator order)."""

    name = "remote"
    #: the rollout hands it the trained module as it is (sharded or not): it gathers it bucket by bucket itself
    gathers_weights = True

    def __init__(self, tokenizer: Any, placement: Placement, parts: list[int], gather: Gather | None = None,
                 lora: bool = False) -> None:
        """``gather``: the trainers' Strategy's ``gathered`` (whole tensors from shards, collectively); ``lora``:
        the policy is a LoRA model: only its adapters are sent, its base checked once (:func:`check_base`)."""
        self.tokenizer, self.placement, self.parts = tokenizer, placement, parts
        self.gather = gather or as_is
        self.lora, self.base_checked = lora, False
        self.received = Received()
        self._scores: dict[str, dict[str, list[float]]] = {}

    @classmethod
    def from_settings(cls, tokenizer: Any, settings: Any, run: Any) -> RemoteEngine:
        raise TypeError("the remote engine is built by the online loop of a separate placement, not by name")

    def with_tokenizer(self, tokenizer: Any) -> RemoteEngine:
        raise ValueError("rollout.placement: separate generates the policy's completions only (a role of its own "
                         "tokenizer generates in an algorithm with its own rollout: use placement: colocated)")

    def sync_weights(self, model: nn.Module) -> bool:
        """Every trainer takes part in gathering ``model``'s weights (the adapters of a LoRA policy) bucket by
        bucket; trainer rank 0 broadcasts them to the generators (they take every version in order)."""
        start = time.perf_counter()
        if self.lora and not self.base_checked:
            check_base(frozen_tensors(model), self.placement, self.gather)
            self.base_checked = True
        sent = push_weights(sync_tensors(model, lora=self.lora), self.placement, self.gather)
        self.received.sync_s, self.received.sync_bytes = time.perf_counter() - start, sent
        return self.placement.env.rank == 0

    def generate(self, model: nn.Module, prompts: Sequence[Prompt] | Sequence[list[int]], params: SamplingParams,
                 *, synced: bool = False, progress: str | None = None) -> Generations:
        parts = self._receive([p.seed for p in as_prompts(prompts)])
        self._scores = {name: {fn: [v for d in parts for v in d.scores[name][fn]] for fn in parts[0].scores[name]}
                        for name in (parts[0].scores if parts else {})}
        return Generations([c for d in parts for c in d.completion_ids], [r for d in parts for r in d.finish_reasons],
                           [t for d in parts for t in d.texts], self.received.logps)

    def scored(self, signal: str) -> dict[str, list[float]] | None:
        """The generators' function scores of the last completions received (module docstring), taken once."""
        return self._scores.pop(signal, None)

    def delivered(self, seeds: list[int] | None) -> tuple[list[Any], dict[str, float]]:
        """What the generators made of this trainer's rows in an algorithm's own split rollout (``grpo_agent``:
        trajectories), in row order (``seeds``: the rows' own), and their phase seconds (max over generators)."""
        parts = self._receive(seeds or [])
        seconds = {k: max(d.seconds.get(k, 0.0) for d in parts) for d in parts for k in d.seconds}
        return [x for d in parts for x in (d.items or [])], seconds

    def _receive(self, seeds: list[int | None]) -> list[Delivery]:
        """This trainer's deliveries of the iteration from every generator that holds some of its rows, checked to
        answer exactly the rows of ``seeds``; the versions, behaviour log-probs and seconds kept in
        :attr:`received`."""
        start = time.perf_counter()
        parts: list[Delivery] = [recv_object(src, self.placement) for src in self.parts]
        wait = time.perf_counter() - start
        if [s for d in parts for s in d.seeds] != list(seeds):
            raise RuntimeError(f"the generators answered other requests than this trainer asked for (iteration "
                               f"{parts[0].iteration if parts else '?'}): the trainers and generators disagree on "
                               "the prompt order or the seeds")
        logps = [lp for d in parts for lp in (d.logps or [])] if all(d.logps is not None for d in parts) else None
        self.received = Received([d.version for d in parts for _ in d.seeds], logps,
                                 max((d.idle_s for d in parts), default=0.0),
                                 max((d.generate_s for d in parts), default=0.0), wait, self.received.sync_s,
                                 self.received.sync_bytes, max((d.scored_by for d in parts), default=-1),
                                 {k: max(d.phases.get(k, 0.0) for d in parts) for k in {p for d in parts for p in d.phases}})
        return parts


def generator_parts(n_completions: int, generators: int, trainers: int) -> list[list[tuple[int, int]]]:
    """For each generator, the global completion range it samples each iteration (its contiguous 1/M share of
    ``n_completions``) cut into per-trainer pieces: ``parts[g][t] = (start, stop)`` of trainer ``t``'s share
    (``stop == start``: none)."""
    per_gen, per_trainer = n_completions // generators, n_completions // trainers
    out = []
    for g in range(generators):
        lo, hi = g * per_gen, (g + 1) * per_gen
        out.append([(max(lo, t * per_trainer), max(max(lo, t * per_trainer), min(hi, (t + 1) * per_trainer)))
                    for t in range(trainers)])
    return out


def trainer_sources(placement: Placement, n_completions: int, trainer: int) -> list[int]:
    """The global ranks of the generators that sample some of trainer ``trainer``'s completions, in order."""
    parts = generator_parts(n_completions, len(placement.generators), placement.trainers)
    return [rank for rank, part in zip(placement.generators, parts) if part[trainer][0] < part[trainer][1]]


def keep_behaviour_logps(samples: list[Sample], logps: list[list[float]] | None) -> None:
    """Each sample's ``sampler_logps``: the generator's log-probs of its tokens (the behaviour policy, which
    an off-policy correction of the loss weighs against the trainer's recomputed ``old_logps``), unless the
    rollout kept the engine's own already."""
    for s, lp in zip(samples, logps or [], strict=bool(logps)):
        s.setdefault("sampler_logps", lp)


def tag_staleness(samples: list[Sample], versions: list[int], version: int, max_staleness: int,
                  stats: MetricSums) -> list[Sample]:
    """Each sample's ``policy_version`` (of ``versions``) and ``staleness`` (trainer ``version`` minus it); the
    samples within ``max_staleness`` are kept, the others dropped and counted. Statistics over every trainer (the
    same on each: a host reduction): ``staleness/mean``, ``staleness/max``, ``staleness/<s>`` (samples of each
    staleness s <= max_staleness + 1; older ones count in the last) and ``staleness/dropped``."""
    kept, counts = [], [0.0] * (max_staleness + 2)
    for s, v in zip(samples, versions, strict=True):
        s["policy_version"], s["staleness"] = v, version - v
        counts[min(version - v, max_staleness + 1)] += 1
        if version - v <= max_staleness:
            kept.append(s)
    ages = [float(version - v) for v in versions]
    total = comm.all_reduce_host_sum([*counts, sum(ages), float(len(ages))])
    oldest = comm.all_reduce_max(torch.tensor(max(ages, default=0.0), dtype=torch.float64))
    stats.add("staleness/mean", total[-2] / max(1.0, total[-1]), 1)
    stats.add("staleness/max", float(oldest), 1)
    for age, n in enumerate(total[: max_staleness + 2]):
        stats.add(f"staleness/{age}", n, 1)
    stats.add("staleness/dropped", total[max_staleness + 1], 1)
    return kept
