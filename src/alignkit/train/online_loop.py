"""The online training loop shared by every online algorithm (GRPO / RLOO / Dr.GRPO, PPO, PPO-Lag).

One iteration (module docstring of ``algorithms/online.py`` for the batch semantics):

1. prompts: the next ``global_batch / num_generations`` prompts of the epoch's seeded global order,
   each repeated ``num_generations`` times; rank r takes the r-th contiguous slice of completions;
2. rollout: the algorithm's ``rollout`` (``algorithms/online.py``; by default the engine generates
   this rank's completions from the policy's full parameters, gathered once (``Strategy.full_params``),
   in eval mode with the KV cache on; every signal (reward, cost) scores them, gathered from every
   rank in global order; the algorithm fills its per-token fields: log-probs, values, advantages);
   the loop names no role;
3. update: ``rollout.update_epochs`` passes over this rank's samples, each ``rollout.mini_batches``
   optimizer steps over disjoint slices (sample i in slice i mod mini_batches: the same global split
   over any number of ranks), in ``per_device`` micro-batches through the shared step code (global
   normaliser, ``no_sync``, one reduction of the step's metrics).

Checkpoints fall on iteration ends and carry every trainable role, the schedules, every rank's RNG, the prompt
position and the algorithm's state. Each completion is sampled from its own seed (``rollout/seeds.py``: the run's
seed, the iteration, the prompt, its index in the group), so a resumed run, and a run on any number of
processes, samples the same completions.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from alignkit.algorithms.base import Context
from alignkit.algorithms.online import OnlineAlgorithm
from alignkit.config import RunConfig, dump_yaml
from alignkit.config.loader import BatchPlan
from alignkit.data.sampler import GlobalOrder
from alignkit.distributed import comm
from alignkit.distributed.placement import Placement, broadcast_start
from alignkit.distributed.strategy.base import Strategy
from alignkit.errors import ConfigError, DataError
from alignkit.logging import RunLogger
from alignkit.models.roles import Models
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import Experience, RolloutContext
from alignkit.rollout.engine import RolloutEngine, SamplingParams, build_engine
from alignkit.rollout.experience import Sample, micro_batches
from alignkit.rollout.remote import RemoteEngine, keep_behaviour_logps, tag_staleness, trainer_sources
from alignkit.rollout.seeds import completion_seeds, eval_seeds
from alignkit.train.evaluate import evaluate_at_start
from alignkit.train.interrupt import InterruptWatch, note_late_signal, stop_if_requested
from alignkit.train.offline_loop import TrainResult
from alignkit.train.optim import build_scheduler
from alignkit.train.run_plan import RunPlan, StepPlan
from alignkit.train.step import (
    Checkpointer,
    NonfiniteGuard,
    TrainState,
    accumulate,
    log_window,
    optimizer_step,
)
from alignkit.train.step_metrics import StepResult, Window, step_result


class OnlineTrainer:
    def __init__(self, cfg: RunConfig, algo: OnlineAlgorithm, strategy: Strategy, models: Models, plan: RunPlan,
                 prompts: list[dict[str, Any]], eval_prompts: list[dict[str, Any]], logger: RunLogger,
                 placement: Placement | None = None) -> None:
        assert plan.steps is not None, "the run plan needs its step counts (online_steps)"
        self.cfg, self.algo, self.strategy, self.models, self.plan = cfg, algo, strategy, models, plan
        self.prompts, self.eval_prompts, self.log = prompts, eval_prompts, logger
        self.G = cfg.section(RolloutConfig).num_generations
        b = plan.batch
        self.n_local = b.per_device * b.accumulation
        self.per_iteration = b.global_batch // self.G
        self.order = GlobalOrder(len(prompts), 1, 0, 1, seed=cfg.training.seed)
        r = cfg.section(RolloutConfig)
        if r.eval_samples and not algo.sampled_eval:
            raise ConfigError(f"rollout.eval_samples={r.eval_samples}: {algo.name} has no sampled evaluation (set 0)")
        self.engine = build_engine(r.engine, algo.tokenizer, cfg, max_new_tokens=r.max_new_tokens)
        #: rollouts: the engine (colocated), or the generator processes' completions (placement: separate;
        #: evaluation still generates here, greedily)
        self.placement = placement
        self.remote = None if placement is None else RemoteEngine(
            algo.tokenizer, placement, trainer_sources(placement, b.global_batch, self.strategy.dp_rank),
            self.strategy.gathered, models.specs[models.primary].lora)
        self.out = Path(cfg.output_dir)
        #: seconds of the last iteration's logging and evaluation + checkpointing (logged with the next one)
        self._tail_s: dict[str, float] = {}
        self._phases_s: dict[str, float] = {}  # of the last rollout
        self.checkpointer = Checkpointer(self.out, strategy, models, config_yaml=dump_yaml(cfg), tokenizer=algo.tokenizer,
                                         save_total_limit=cfg.checkpoint.save_total_limit, log=logger, batch=b)

    # ------------------------------------------------------------------ main
    def fit(self) -> TrainResult:
        cfg, log, total = self.cfg, self.log, self.plan.steps.total
        for handle in self.models.handles.values():
            handle.scheduler = build_scheduler(handle.optimizer, cfg.training, total)
        self._startup_lines()
        # the one start hook of both loops (here: rollout.disable_dropout), before a resume like offline
        self.algo.before_training(Context(self.models, self.strategy), self.prompts, self.eval_prompts)
        # completions draw from their own seeds (rollout/seeds.py); the global generator, distinct per rank,
        # serves what else draws at random (an algorithm's own sampling)
        torch.manual_seed(cfg.training.seed + 1_000_003 * self.strategy.dp_rank)
        state = self._resume()
        if self.placement is not None:  # the generators start where this run starts (a resume's position)
            broadcast_start({"step": state.step, "epoch": state.epoch, "consumed": state.consumed}, self.placement)
        window, losses, metrics, eval_metrics = Window(), [], {}, {}
        guard = NonfiniteGuard(cfg.training.nonfinite, cfg.training.max_nonfinite_steps, log)
        if self.eval_prompts:  # where the policy starts: the eval curves' first point
            eval_metrics = evaluate_at_start(self._evaluate, enabled=cfg.training.eval_before_train is not False, step=state.step)
        log.start_progress(total, initial=state.step)
        self.models.train()
        with InterruptWatch(cfg.checkpoint.save_on_interrupt) as watch:
            while state.step < total:
                lr = self.models.handles[self.models.primary].scheduler.get_last_lr()[0]
                experience, rollout_s = self._rollout(state)
                samples, stats = experience.samples, experience.stats
                results, update_s = self._update(samples, state, guard, losses)
                result = results[-1]
                stats.add("rollout_s", rollout_s, 1)
                stats.add("update_s", update_s, 1)
                stats.add("train_tokens_per_s", sum(r.tokens for r in results) / max(update_s, 1e-9), 1)
                self._add_times(stats, rollout_s, self._phases_s, update_s)
                tail = time.perf_counter()
                for r in results:
                    window.add(r)
                window.sums.merge(stats)  # identical on every rank already: not reduced again
                iteration = stats.means()  # one read-back of the iteration's statistics
                extra = self.algo.on_iteration_end(Context(self.models, self.strategy, state.step,
                                                           {**result.metrics, **iteration}), experience)
                log.advance({"loss": result.loss, "reward": iteration.get("reward_mean", math.nan)})
                first = state.step == len(results) and cfg.logging.logging_first_step  # a fresh run's first iteration
                if first or self._crossed(cfg.logging.logging_steps, state.step, len(results)) or state.step == total:
                    metrics = log_window(log, self.strategy, window, state, self._epoch(state), lr, result, extra)
                    self._log_samples(state.step, samples)
                self._tail_s["log"], tail = time.perf_counter() - tail, time.perf_counter()
                if self.eval_prompts and self._crossed(cfg.training.eval_steps, state.step, len(results)) and state.step < total:
                    eval_metrics = self._evaluate(state.step)
                if self._crossed(cfg.checkpoint.save_steps, state.step, len(results)) and state.step < total:
                    self._save(state)
                self._tail_s["eval_save"] = time.perf_counter() - tail
                if state.step < total:  # a signal: a checkpoint at this iteration's end, then stop
                    stop_if_requested(watch, state, self.checkpointer, self._save, log)
            # still watched: a signal now (the last save, the pruning, final/) lets the run end whole first
            if self.eval_prompts:
                eval_metrics = self._evaluate(state.step)
            final_dir = self.checkpointer.finish(
                lambda: self._save(state), save_steps=cfg.checkpoint.save_steps, save_final=cfg.checkpoint.save_final,
                final_weights=lambda: self.algo.output_weights(Context(self.models, self.strategy, state.step)))
            note_late_signal(watch, log)
        log.close()
        return TrainResult(final_dir, metrics, eval_metrics, losses)

    def _resume(self) -> TrainState:
        """The run's state: a fresh one, or the checkpoint's (``checkpoint.resume_from``) with the algorithm's."""
        ck = self.cfg.checkpoint
        state = self.checkpointer.resume(ck.resume_from, weights_only=ck.resume_weights_only)
        self.algo.load_state_dict(state.algo)
        if self.checkpointer.resumed is not None:
            self.algo.load_files(self.checkpointer.resumed, Context(self.models, self.strategy, state.step))
        return state

    def _update(self, samples: list[Sample], state: TrainState, guard: NonfiniteGuard,
                losses: list[float]) -> tuple[list[StepResult], float]:
        """The iteration's optimizer steps over its samples (up to the run's last step), each step's loss
        appended to ``losses``; the steps' results and the seconds they took."""
        start = time.perf_counter()
        results = []
        for part in self._mini_batches(samples):
            if state.step >= self.plan.steps.total:
                break
            results.append(self._step(part))
            state.step += 1
            self.algo.on_optimizer_step(Context(self.models, self.strategy, state.step))
            guard.observe(state.step, results[-1])
            losses.append(results[-1].loss)
        return results, time.perf_counter() - start

    def _mini_batches(self, samples: list[Sample]) -> list[list[Sample]]:
        """The iteration's optimizer steps in order: per update epoch, ``rollout.mini_batches`` disjoint slices.
        Slice m holds the samples at positions = m (mod mini_batches): with a rank's completions a multiple of
        it (``check_groups``) that is global index = m, so one process and any number of ranks take the same
        steps (flow_grpo's units, (image, step) pairs listed step-major, follow their image's slice)."""
        r = self.cfg.section(RolloutConfig)
        return [samples[m :: r.mini_batches] for _ in range(r.update_epochs) for m in range(r.mini_batches)]

    def _step(self, samples: list[Sample]) -> StepResult:
        group = [self.algo.collate(mb) for mb in micro_batches(samples, self.plan.batch.per_device)]
        strategy, models = self.strategy, self.models
        losses, sums, tokens = accumulate(strategy, models, group, self.algo.loss, self.algo.units, self.algo.tokens_in)
        norms, dropped, role_sums = optimizer_step(strategy, models, self.cfg.training.max_grad_norm, losses)
        return step_result(strategy, models, role_sums, sums, tokens, norms, dropped)

    # ------------------------------------------------------------------ rollout
    def _context(self, rows: list[dict[str, Any]], mine: slice, params: SamplingParams,
                 seeds: list[int] | None = None, engine: RolloutEngine | None = None,
                 refill: Callable[[], tuple[list[dict[str, Any]], list[int]]] | None = None) -> RolloutContext:
        return RolloutContext(self.models, self.strategy, engine or self.engine, rows, mine, params,
                              self.plan.batch.per_device, self.algo.collate,
                              gather_full_params=self.cfg.section(RolloutConfig).gather_full_params, seeds=seeds,
                              refill=refill)

    def _rollout(self, state: TrainState) -> tuple[Experience, float]:
        """The algorithm's rollout of this rank's share of the iteration's prompts and its seconds (those of
        its phases, :attr:`RolloutContext.seconds`, are kept in ``_phases_s``)."""
        start = time.perf_counter()
        r = self.cfg.section(RolloutConfig)
        version = state.step // r.steps_per_iteration  # the weights of this iteration: after `version` updates
        completions, seeds = iteration_requests(self.order, state, self.per_iteration, self.cfg)
        rank = self.strategy.dp_rank
        mine = slice(rank * self.n_local, (rank + 1) * self.n_local)
        params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.generation_batch_size)
        # DAPO's dynamic sampling: a rollout may take the next prompts of the order (consumed as an iteration's),
        # each completion with its own seed as the iteration's
        def refill() -> tuple[list[dict[str, Any]], list[int]]:
            more, more_seeds = iteration_requests(self.order, state, self.per_iteration, self.cfg)
            return [self.prompts[i] for i in more[mine]], more_seeds[mine]

        ctx = self._context([self.prompts[i] for i in completions[mine]], mine, params, seeds[mine], self.remote,
                            refill if self.remote is None else None)
        self._phases_s = ctx.seconds
        experience = self.algo.rollout(ctx)
        if self.remote is not None:
            got = self.remote.received
            keep_behaviour_logps(experience.samples, got.logps)
            experience.samples = tag_staleness(experience.samples, got.versions, version, r.max_staleness,
                                               experience.stats)
            for name, seconds in (("trainer_wait_s", got.wait_s), ("weight_sync_s", got.sync_s),
                                  ("weight_sync_bytes", float(got.sync_bytes)),
                                  ("generator_idle_s", got.generator_idle_s),
                                  ("generator_generate_s", got.generator_generate_s),
                                  ("reward_model_rank", float(got.scored_by))):
                experience.stats.add(f"async/{name}", seconds, 1)
            for phase, seconds in got.generator_phases.items():
                experience.stats.add(f"async/generator_{phase}_s", seconds, 1)
        return experience, time.perf_counter() - start

    def _add_times(self, stats: Any, rollout_s: float, phases: dict[str, float], update_s: float) -> None:
        """``time/<phase>_s``: where an iteration goes on this rank (rollout phases, the rest of the rollout,
        the update; logging and evaluation + checkpointing of the iteration before, which ran after its
        metrics were taken). ``perf_counter`` only: no device synchronisation is added."""
        for phase, seconds in phases.items():
            stats.add(f"time/{phase}_s", seconds, 1)
        stats.add("time/rollout_other_s", max(0.0, rollout_s - sum(phases.values())), 1)
        stats.add("time/update_s", update_s, 1)
        for phase, seconds in self._tail_s.items():
            stats.add(f"time/{phase}_s", seconds, 1)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def _evaluate(self, step: int) -> dict[str, float]:
        """Greedy completions of every eval prompt exactly once (interleaved shares), scored by the algorithm's
        ``evaluate`` (eval/*); with ``rollout.eval_samples`` n, also n completions per prompt sampled at the
        rollout's settings from their own seeds (``rollout/seeds.py: eval_seeds``), logged as eval/sampled_*."""
        r = self.cfg.section(RolloutConfig)
        mine = list(range(self.strategy.dp_rank, len(self.eval_prompts), self.strategy.dp_size))
        rows = [self.eval_prompts[i] for i in mine]
        greedy = SamplingParams(r.max_new_tokens, 0.0, batch_size=r.generation_batch_size)
        metrics = self._eval_pass(step, rows, greedy, None, len(self.eval_prompts))
        if r.eval_samples:
            n, sampled = r.eval_samples, SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k,
                                                        r.generation_batch_size)
            seeds = eval_seeds(self.cfg.training.seed, mine, n)
            more = self._eval_pass(step, [row for row in rows for _ in range(n)], sampled, seeds,
                                   n * len(self.eval_prompts))
            metrics |= {f"sampled_{k}": v for k, v in more.items()}
        self.log.log_metrics(step, metrics, prefix="eval/")
        return metrics

    def _eval_pass(self, step: int, rows: list[dict[str, Any]], params: SamplingParams, seeds: list[int] | None,
                   total: int) -> dict[str, float]:
        """One evaluation of this rank's ``rows`` (``total`` over every rank): the algorithm's sums reduced over
        ranks, then the reward mean, the completion length and the algorithm's own :meth:`eval_metrics`."""
        names = ("reward", "scored", "tokens", *self.algo.eval_sums)
        with self.algo.output_weights(Context(self.models, self.strategy, step)):
            every = rows or self.algo.evaluate_on_every_rank
            local = self.algo.evaluate(self._context(rows, slice(0, len(rows)), params, seeds)) if every \
                else (0.0,) * len(names)
        sums = dict(zip(names, comm.all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()))
        return {"reward_mean": sums["reward"] / max(1.0, sums["scored"]),
                "completion_length": sums["tokens"] / max(1, total), **self.algo.eval_metrics(sums)}

    # ------------------------------------------------------------------ helpers
    def _startup_lines(self) -> None:
        b, steps, r = self.plan.batch, self.plan.steps, self.cfg.section(RolloutConfig)
        self.log.info(f"Effective batch size: {b.global_batch} completions (per_device={b.per_device} x "
                      f"accumulation={b.accumulation} x {self.strategy.dp_size} processes) = {self.per_iteration} "
                      f"prompts x {self.G} generations per iteration")
        self.log.info(f"Training: {len(self.prompts)} prompts, {steps.per_epoch} optimizer steps per epoch, {steps.total} "
                      f"steps in all ({r.steps_per_iteration} per iteration), lr={self.plan.lr:.3g}, "
                      f"{self.algo.sampling_summary()}")

    def _epoch(self, state: TrainState) -> float:
        return state.epoch + state.consumed / max(1, self.order.usable())

    @staticmethod
    def _crossed(every: int | None, step: int, taken: int) -> bool:
        """Whether a multiple of ``every`` lies in the ``taken`` steps that ended at ``step``."""
        return bool(every) and (step // every) > ((step - taken) // every)

    def _log_samples(self, step: int, samples: list[Sample]) -> None:
        n = self.cfg.section(RolloutConfig).log_samples
        if not n or not self.strategy.is_main or "jsonl" not in self.cfg.logging.report_to:
            return
        with (self.out / "samples.jsonl").open("a", encoding="utf-8") as fh:
            for s in samples[:n]:
                fh.write(json.dumps({"step": step, "prompt": s.get("prompt"), "completion": s.get("completion"),
                                     "advantage": s["advantages"][0] if s.get("advantages") else None,
                                     **s.get("log", {})}, ensure_ascii=False) + "\n")

    def _save(self, state: TrainState) -> Path:
        state.algo = self.algo.state_dict()
        return self.checkpointer.save(state, lambda folder: self.algo.save_files(folder, Context(self.models, self.strategy, state.step)))


def next_prompts(order: GlobalOrder, state: TrainState, per_iteration: int) -> list[int]:
    """The iteration's prompt indices (global), advancing ``state``'s position in the epoch's order."""
    epoch_order = order.order(state.epoch)
    if state.consumed + per_iteration > len(epoch_order):
        state.epoch, state.consumed = state.epoch + 1, 0
        epoch_order = order.order(state.epoch)
    idx = epoch_order[state.consumed : state.consumed + per_iteration].tolist()  # order() is a numpy array
    state.consumed += per_iteration
    return idx


def iteration_requests(order: GlobalOrder, state: TrainState, per_iteration: int,
                       cfg: RunConfig) -> tuple[list[int], list[int]]:
    """The iteration starting at ``state`` (its position advanced): the prompt index of each completion in
    global order (a prompt's ``num_generations`` consecutive) and each completion's seed (``rollout/seeds.py``).
    Trainers and generator processes compute the same from the same state."""
    r = cfg.section(RolloutConfig)
    iteration = state.step // r.steps_per_iteration
    completions = [i for i in next_prompts(order, state, per_iteration) for _ in range(r.num_generations)]
    return completions, completion_seeds(cfg.training.seed, iteration, completions, r.num_generations)


def check_groups(plan: RunPlan, cfg: RunConfig) -> None:
    """The global batch (completions) must hold whole groups of ``num_generations``, and each rank's
    completions split evenly into ``rollout.mini_batches``."""
    r, b = cfg.section(RolloutConfig), plan.batch
    G, M = r.num_generations, r.mini_batches
    if b.global_batch % G:
        raise ConfigError(f"training.global_batch_size ({b.global_batch} completions = per_device {b.per_device} x "
                          f"accumulation {b.accumulation} x {b.world_size} processes) must be a multiple of "
                          f"rollout.num_generations ({G})")
    if (b.per_device * b.accumulation) % M:
        raise ConfigError(f"rollout.mini_batches: each process's {b.per_device * b.accumulation} completions per "
                          f"iteration (per_device {b.per_device} x accumulation {b.accumulation}) must split into "
                          f"{M} equal slices")


def online_steps(n_prompts: int, plan: RunPlan, cfg: RunConfig) -> RunPlan:
    """The run plan with its step counts: one epoch = every prompt once (in whole iterations)."""
    import dataclasses

    check_groups(plan, cfg)
    return dataclasses.replace(plan, steps=online_step_plan(n_prompts, plan.batch, cfg))


def online_step_plan(n_prompts: int, b: BatchPlan, cfg: RunConfig) -> StepPlan:
    """Steps of an online run over ``n_prompts``: an iteration draws global_batch / num_generations prompts and
    takes update_epochs x mini_batches optimizer steps (``alignkit validate`` and ``launch`` count the same)."""
    per_iteration = b.global_batch // cfg.section(RolloutConfig).num_generations
    iterations = n_prompts // per_iteration
    if iterations == 0:
        raise DataError(f"the prompt set has {n_prompts} prompts, fewer than the {per_iteration} one iteration needs")
    per_epoch = iterations * cfg.section(RolloutConfig).steps_per_iteration
    t = cfg.training
    total = t.max_steps if t.max_steps is not None else max(1, math.ceil(per_epoch * t.epochs))
    return StepPlan(iterations * b.accumulation, per_epoch, total)


__all__ = ["OnlineTrainer", "check_groups", "iteration_requests", "next_prompts", "online_step_plan", "online_steps"]
