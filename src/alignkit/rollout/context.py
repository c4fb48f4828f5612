"""What an online algorithm's ``rollout`` works with: this rank's prompts and the run's models, engine
and Strategy, with the steps every rollout is made of (generate from a role, build the scorers'
inputs, score and gather) as methods. The loop builds one per iteration and knows no role names; the
algorithm decides which roles generate and what is scored (red-team RL sends the policy's outputs
through a frozen ``target`` role first).
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from alignkit.data.batch import Batch
from alignkit.distributed import comm
from alignkit.metrics import MetricSums
from alignkit.rewards.signals import ScoreInputs, Signal, gather_scores, nan_stats
from alignkit.rollout.engine import Generations, Prompt, RolloutEngine, SamplingParams, generation_phase
from alignkit.rollout.experience import Sample, micro_batches
from alignkit.rollout.seeds import with_stream

if TYPE_CHECKING:
    from alignkit.distributed.strategy.base import Strategy
    from alignkit.models.roles import Models


class LazyBatches(Sequence[Batch]):
    """Micro-batches made by ``make()`` on first use: a rollout scored by functions alone that needs no
    log-probs before the update (GRPO at beta 0, one update epoch) never collates them."""

    def __init__(self, make: Callable[[], list[Batch]]) -> None:
        self._make, self._batches = make, None

    def _all(self) -> list[Batch]:
        if self._batches is None:
            self._batches = self._make()
        return self._batches

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())


@dataclass
class Experience:
    """One rollout's result: this rank's samples with their per-token fields filled (what the update
    trains on), the gathered scores by signal (``(global,)``) and the iteration's statistics (the same
    on every rank), and the records of the iteration that its end writes out (red-team RL: every rank's
    attacks with their answers and scores, for attacks.jsonl): what the update and the logging need, so the
    algorithm keeps nothing of a rollout on ``self``."""

    samples: list[Sample]
    scores: dict[str, torch.Tensor]
    stats: MetricSums
    records: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RolloutContext:
    """This rank's share of one iteration: ``rows`` (prompt rows: ``prompt``, ``prompt_ids``, ``fields``),
    ``mine`` (their slice of the iteration's global order), sampling ``params``, and the run's models,
    engine and Strategy. ``collate`` turns samples into a micro-batch; ``per_device`` is its size."""

    models: Models
    strategy: Strategy
    engine: RolloutEngine
    rows: list[dict[str, Any]]
    mine: slice
    params: SamplingParams
    per_device: int
    collate: Callable[[list[Sample]], Batch]
    gather_full_params: bool = True
    #: each row's sampling seed (``rollout/seeds.py``: from the run's seed, the iteration, the prompt and the
    #: completion's place in its group), or None: the process's generator. :meth:`generate` hands a role's
    #: token prompts these seeds (another role's derived from them), so completions do not depend on where
    #: they are generated
    seeds: list[int] | None = None
    #: seconds by phase of this rollout (``generate``, ``score_inputs``, ``score``, ``experience``), summed over
    #: calls; the loop logs them as ``time/<phase>_s`` (this rank's, a cheap clock: no synchronisation)
    seconds: dict[str, float] = field(default_factory=dict)
    #: this rank's rows of the next prompts of the run's order (consumed as an iteration's are) and their seeds, for a
    #: rollout that draws more than its batch (DAPO's dynamic sampling, algorithms/dynamic_sampling.py); None: no more
    #: prompts (also under separate placement, where the generators draw the iteration's rows)
    refill: Callable[[], tuple[list[dict[str, Any]], list[int] | None]] | None = None

    @property
    def generate_s(self) -> float:
        """Seconds spent generating (summed over :meth:`generate` calls), for tokens/s."""
        return self.seconds.get("generate", 0.0)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the block's wall time to ``seconds[phase]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def generate(self, role: str, prompts: list[Any], params: SamplingParams | None = None, *,
                 phase: str = "generate") -> Generations:
        """One output per prompt from ``role`` (trainable or frozen) through its kind's adapter, in one phase of the
        engine's lifecycle (``generation_phase``: the role's weights pushed where they changed, its memory retaken,
        then released), with the role's full parameters gathered once for the call (FSDP2 / ZeRO-3), or, with
        ``rollout.gather_full_params: false``, on the sharded module with every rank stepping together. An engine
        that computes in this thread (``runs_in_caller``: HF generate) runs under the Strategy's autocast, as the
        log-prob forward does. Its seconds count in ``seconds[phase]`` (``generate``: the token phase whose seconds
        give gen_tokens_per_s; an image policy's sampling is its own ``sample`` phase)."""
        kind, module, params = self.models.kind(role), self.models[role], params or self.params
        prompts = self.seeded(role, prompts)
        with self.timed(phase), ExitStack() as stack:
            engine = self.engine_for(role)
            if engine.runs_in_caller:  # fp32 master weights decode in bf16, not in fp32 GEMMs
                stack.enter_context(self.strategy.autocast())
            if (self.gather_full_params and not engine.gathers_weights) or not self.strategy.frozen_plan():
                plain = stack.enter_context(self.strategy.full_params(module))
                stack.enter_context(generation_phase(engine, plain))
                return kind.generate(plain, engine, prompts, params)
            if not (engine.generates_sharded or engine.gathers_weights):
                raise ValueError(f"rollout.engine: {engine.name} generates from the full weights; set "
                                 "rollout.gather_full_params: true")
            sharded = self.strategy.unwrap(module)
            stack.enter_context(generation_phase(engine, sharded))
            return kind.generate(sharded, engine, prompts, params, synced=True)

    def seeded(self, role: str, prompts: list[Any]) -> list[Any]:
        """Token ``prompts`` (id lists or :class:`Prompt` s, one per row) as :class:`Prompt` s carrying the
        rows' seeds of ``role``'s stream; other prompts (an image policy's, seeded per image already), prompts
        that all carry seeds already, a count other than the rows', or a context without seeds: unchanged."""
        if all(isinstance(p, Prompt) and p.seed is not None for p in prompts):
            return prompts  # seeded by the caller already (an agent's later turns: rollout/agents/trajectory.py)
        if self.seeds is None or len(prompts) != len(self.seeds):
            return prompts
        if not all(isinstance(p, (list, Prompt)) for p in prompts):
            return prompts
        return [replace(p, seed=s) if isinstance(p, Prompt) else Prompt(list(p), seed=s)
                for p, s in zip(prompts, with_stream(self.seeds, role))]

    def items(self, make: Callable[[], tuple[list[Any], dict[str, float]]],
              role: str = "policy") -> tuple[list[Any], dict[str, float]]:
        """An algorithm's own split rollout (``split_rollout`` "items"; ``grpo_agent``: trajectories) of :attr:`rows`
        and their seconds by phase: ``make()`` here, or under a separate placement what its generators made of the
        rows (``rollout/remote.py`` ``RemoteEngine.delivered``), in one generation phase of the remote engine
        (trainer rank 0 pushes ``role``'s weights first). The algorithm does not see where they were made."""
        if self.engine.name != "remote":
            return make()
        with self.timed("generate"), ExitStack() as stack:
            plain = stack.enter_context(self.strategy.full_params(self.models[role]))
            stack.enter_context(generation_phase(self.engine, plain))
            return self.engine.delivered(self.seeds)  # type: ignore[attr-defined]  # the remote engine's

    def engine_for(self, role: str) -> RolloutEngine:
        """The run's engine, or for a role with a tokenizer of its own (a red-team target of another family)
        the engine's copy with the same settings padding, stopping and decoding with that tokenizer."""
        mine, policy = self.models.tokenizer(role), self.models.tokenizer("policy")
        if mine is None or mine is policy:
            return self.engine
        return self.engine.with_tokenizer(mine)

    def samples(self, completion_ids: list[list[int]]) -> list[Sample]:
        """Samples (this rank's prompt ids + the given completion ids), in the order of ``rows``."""
        return [{"prompt_ids": row["prompt_ids"], "completion_ids": list(ids)} for row, ids in zip(self.rows, completion_ids)]

    def batches(self, samples: list[Sample]) -> list[Batch]:
        """``samples`` collated in ``per_device`` micro-batches, on the device."""
        return [self.collate(mb).to(self.strategy.device) for mb in micro_batches(samples, self.per_device)]

    def score_inputs(self, samples: list[Sample], completions: list[str], prompts: list[Any] | None = None) -> ScoreInputs:
        """What scorers read: the prompts as written (or ``prompts``), completion texts and token counts, row
        fields, and ``samples`` collated for a scalar model."""
        with self.timed("score_inputs"):
            return ScoreInputs(prompts if prompts is not None else [row["prompt"] for row in self.rows], completions,
                               [len(s["completion_ids"]) for s in samples], [row["fields"] for row in self.rows],
                               LazyBatches(lambda: self.batches(samples)))

    def score(self, signals: dict[str, Signal], inputs: ScoreInputs, *, placement: str | None = None) -> dict[str, torch.Tensor]:
        """Every signal's scores of every rank, gathered in global order (``signal`` -> ``(global,)``; a
        signal's parts as ``signal/part``). ``placement`` overrides where the functions run."""
        scores: dict[str, torch.Tensor] = {}
        for name, signal in signals.items():
            with self.timed("score"):  # the functions' scores may come with the completions (separate placement)
                local = signal.score(self.models, inputs, self.strategy, placement=placement,
                                     functions=self.engine.scored(name))
            with self.timed("gather"):
                for part, values in gather_scores(local).items():
                    scores[name if part == "total" else f"{name}/{part}"] = values
        return scores


def rollout_stats(stats: MetricSums, scores: dict[str, torch.Tensor], gens: Generations, gen_s: float) -> None:
    """Score means (total and per part) and the length / truncation / speed of the whole iteration."""
    for name, values in scores.items():
        stats.add(f"{name}_mean" if "/" not in name else name, nan_stats(values)[0], 1)
    lengths = [len(c) for c in gens.completion_ids]
    local = torch.tensor([sum(lengths), len(lengths), sum(gens.truncated), gen_s], dtype=torch.float64)
    total = comm.all_reduce_sum(local[:3])
    gen_max = comm.all_reduce_max(local[3:])
    stats.add("completion_length", float(total[0]) / max(1.0, float(total[1])), 1)
    stats.add("truncated_fraction", float(total[2]) / max(1.0, float(total[1])), 1)
    stats.add("gen_tokens_per_s", float(total[0]) / max(float(gen_max[0]), 1e-9), 1)
