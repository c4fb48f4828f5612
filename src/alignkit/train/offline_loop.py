"""The offline training loop shared by every offline algorithm (SFT, reward/cost models, the DPO family).

It walks the sampler's micro-batches in groups of ``gradient_accumulation_steps`` (fewer only at an
epoch's end) and hands each group to the shared step code (:mod:`alignkit.train.step`): accumulation
with the global normaliser, one optimizer step per trainable role, one reduction of the step's
metrics, the log window, evaluation and checkpoints. The LR schedule counts optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from torch.utils.data import DataLoader

from alignkit.algorithms.base import Batch, Context, Example, OfflineAlgorithm
from alignkit.config import RunConfig, dump_yaml
from alignkit.data.examples import subset
from alignkit.data.sampler import GlobalOrder
from alignkit.data.streaming import RowStream
from alignkit.distributed import comm
from alignkit.distributed.strategy.base import Strategy
from alignkit.logging import RunLogger
from alignkit.models.roles import Models
from alignkit.train.evaluate import evaluate, evaluate_at_start
from alignkit.train.interrupt import InterruptWatch, note_late_signal, stop_if_requested
from alignkit.train.optim import build_scheduler
from alignkit.train.run_plan import RunPlan
from alignkit.train.step import (
    Checkpointer,
    NonfiniteGuard,
    TrainState,
    accumulate,
    log_window,
    optimizer_step,
)
from alignkit.train.step_metrics import LazyMetrics, StepResult, Window, step_result


@dataclass
class TrainResult:
    final_dir: Path | None
    metrics: dict[str, float]
    eval_metrics: dict[str, float]
    losses: list[float]


class _Rounds:
    """A batch sampler over a one-pass iterable of index lists (DataLoader asks for an iterable)."""

    def __init__(self, rounds: Iterator[list[int]]) -> None:
        self.rounds = rounds

    def __iter__(self) -> Iterator[list[int]]:
        return self.rounds


class OfflineTrainer:
    def __init__(self, cfg: RunConfig, algo: OfflineAlgorithm, strategy: Strategy, models: Models, plan: RunPlan,
                 train_set: list[Example], eval_set: list[Example], logger: RunLogger) -> None:
        assert plan.steps is not None, "the run plan needs its step counts (RunPlan.with_steps)"
        self.cfg, self.algo, self.strategy, self.models, self.plan = cfg, algo, strategy, models, plan
        self.train_set, self.eval_set, self.log = train_set, eval_set, logger
        self.steps = plan.steps
        self.out = Path(cfg.output_dir)
        #: data.streaming: the rank's row stream instead of a global order over a prepared set
        self.stream = train_set if isinstance(train_set, RowStream) else None
        self.order = None if self.stream else GlobalOrder(len(train_set), strategy.dp_size, strategy.dp_rank,
                                                          plan.batch.per_device, seed=cfg.training.seed)
        self.checkpointer = Checkpointer(self.out, strategy, models, config_yaml=dump_yaml(cfg), tokenizer=algo.tokenizer,
                                         save_total_limit=cfg.checkpoint.save_total_limit, log=logger,
                                         batch=plan.batch)

    # ------------------------------------------------------------------ main
    def fit(self) -> TrainResult:
        cfg, algo, log, steps = self.cfg, self.algo, self.log, self.steps
        algo.before_training(Context(self.models, self.strategy), self.examples_used(), self.eval_set)
        for handle in self.models.handles.values():
            handle.scheduler = build_scheduler(handle.optimizer, cfg.training, steps.total)
        self._startup_lines()
        state = self.checkpointer.resume(cfg.checkpoint.resume_from, weights_only=cfg.checkpoint.resume_weights_only)
        if self.stream is not None:
            self.stream.restore(state.stream)
        algo.load_state_dict(state.algo)
        if self.checkpointer.resumed is not None and self._epoch_ends(state):
            self._save_epoch(state)  # its epoch_N/ may be missing: killed between that checkpoint and the export
        window, losses = Window(), []
        guard = NonfiniteGuard(cfg.training.nonfinite, cfg.training.max_nonfinite_steps, log)
        metrics: dict[str, float] = {}
        eval_metrics = evaluate_at_start(self._evaluate, enabled=cfg.training.eval_before_train is not False, step=state.step)
        log.start_progress(steps.total, initial=state.step)
        batches = self._micro_batches(state)
        self.models.train()
        with InterruptWatch(cfg.checkpoint.save_on_interrupt) as watch:
            while state.step < steps.total:
                lr = self.models.handles[self.models.primary].scheduler.get_last_lr()[0]
                result = self._step(next(batches))
                state.step += 1
                guard.observe(state.step, result)
                losses.append(result.loss)
                window.add(result)
                extra = algo.on_step_end(Context(self.models, self.strategy, state.step, LazyMetrics(result)))
                log.advance({"loss": result.loss})
                if self._log_due(state.step):
                    metrics = log_window(log, self.strategy, window, state, self._epoch(state), lr, result, extra,
                                         algo.console_keys)
                if self._due(cfg.training.eval_steps, state.step):
                    eval_metrics = self._evaluate(state.step)
                if self._due(cfg.checkpoint.save_steps, state.step):
                    self._save(state)
                if self._epoch_ends(state):
                    self._save_epoch(state)
                if state.step < steps.total:  # a signal: a checkpoint here, then stop (all ranks alike)
                    stop_if_requested(watch, state, self.checkpointer, self._save, log)
            # still watched: a signal now (the last save, the pruning, final/) lets the run end whole first
            if self.eval_set:
                eval_metrics = self._evaluate(state.step)
            final_dir = self.checkpointer.finish(lambda: self._save(state), save_steps=cfg.checkpoint.save_steps,
                                                 save_final=cfg.checkpoint.save_final)
            note_late_signal(watch, log)
        log.close()
        return TrainResult(final_dir, metrics, eval_metrics, losses)

    def _step(self, group: list[Batch]) -> StepResult:
        data, strategy, models = self.algo.data, self.strategy, self.models
        self.algo.before_step(Context(models, strategy), group)
        losses, sums, tokens = accumulate(strategy, models, group, self.algo.loss, data.loss_units, data.tokens_in)
        norms, dropped, role_sums = optimizer_step(strategy, models, self.cfg.training.max_grad_norm, losses)
        return step_result(strategy, models, role_sums, sums, tokens, norms, dropped)

    # ------------------------------------------------------------------ data
    def _micro_batches(self, state: TrainState) -> Iterator[list[Batch]]:
        """Yields the micro-batches of one optimizer step at a time (fewer at an epoch's end), continuing
        from ``state``'s position in the epoch's global order; ``state.consumed`` follows the batches."""
        ga = self.plan.batch.accumulation
        if self.stream is not None:
            yield from self._streamed_batches(ga)
        assert self.order is not None
        while True:
            # two walks of the same rounds, both lazy: the loader's indices (read ahead by workers) and
            # the position after each batch it returns
            indices = (idx for idx, _ in self.order.rounds(state.epoch, state.consumed))
            positions = (consumed for _, consumed in self.order.rounds(state.epoch, state.consumed))
            loader = DataLoader(self.train_set, batch_sampler=_Rounds(indices),
                                collate_fn=self.algo.data.collate, num_workers=self.cfg.data.num_workers)
            group: list[Batch] = []
            for batch, consumed in zip(loader, positions):
                group.append(batch)
                state.consumed = consumed
                if len(group) == ga:
                    yield group
                    group = []
            if group:
                yield group
            state.epoch += 1
            state.consumed = 0

    def _streamed_batches(self, ga: int) -> Iterator[list[Batch]]:
        """data.streaming: ``ga`` micro-batches of the rank's next examples at a time (the stream's
        position follows; it is saved with each checkpoint)."""
        assert self.stream is not None
        per_device, collate = self.plan.batch.per_device, self.algo.data.collate
        while True:
            yield [collate(self.stream.next_examples(per_device)) for _ in range(ga)]

    def examples_used(self) -> list[Example]:
        """The training examples the planned steps read, over all ranks (the same list on every rank):
        all of them once the run passes an epoch, else the first micro-batches of epoch 0's shards.
        What ``before_training`` prepares (e.g. cached reference log-probs), so a short run of a large
        file does not precompute rows it never reads."""
        steps, b = self.steps, self.plan.batch
        if self.order is None:  # a stream: nothing is known ahead
            return []
        if steps.total >= steps.per_epoch:
            return self.train_set
        read = min(steps.total * b.accumulation * b.per_device * b.world_size, self.order.usable())
        return subset(self.train_set, np.sort(self.order.order(0)[:read]))

    # ------------------------------------------------------------------ helpers
    def _startup_lines(self) -> None:
        b, t, steps = self.plan.batch, self.cfg.training, self.steps
        if self.stream is not None:
            self.log.info(f"Training data streamed from {', '.join(self.cfg.data.train)} in file order, rows shared "
                          f"round-robin by {self.strategy.dp_size} processes")
        self.log.info(f"Effective batch size: {b.global_batch} (per_device={b.per_device} x "
                      f"accumulation={b.accumulation} x {self.strategy.dp_size} processes)")
        size = ("a stream of examples" if self.stream is not None else
                f"{len(self.train_set)} examples, {steps.per_epoch} optimizer steps per epoch")
        self.log.info(
            f"Training: {size}, {steps.total} steps in all, lr={self.plan.lr:.3g} ({t.lr_scheduler}), "
            f"dtype={str(self.strategy.compute_dtype).replace('torch.', '')}")

    def _epoch(self, state: TrainState) -> float:
        if self.order is None:
            return float(self.stream.pos.epoch) if self.stream is not None else 0.0
        return state.epoch + state.consumed / self.order.usable()

    def _due(self, every: int | None, step: int) -> bool:
        """Whether a periodic action (eval, save) falls on ``step``; the last step has its own."""
        return bool(every) and step % every == 0 and step < self.steps.total

    def _log_due(self, step: int) -> bool:
        first = step == 1 and self.cfg.logging.logging_first_step
        return first or step % self.cfg.logging.logging_steps == 0 or step == self.steps.total

    def _evaluate(self, step: int) -> dict[str, float]:
        if not self.eval_set:
            return {}
        t = self.cfg.training
        metrics = evaluate(self.algo, self.models, self.eval_set, self.strategy,
                           batch_size=t.eval_batch_size or self.plan.batch.per_device)
        self.log.log_metrics(step, metrics, prefix="eval/")
        return metrics

    def _epoch_ends(self, state: TrainState) -> bool:
        """Whether ``state`` is the end of an epoch whose model is exported (``checkpoint.save_each_epoch``)."""
        return self.cfg.checkpoint.save_each_epoch and self.order is not None and state.consumed >= self.order.usable()

    def _save_epoch(self, state: TrainState) -> None:
        """``epoch_N/``: the model at the end of epoch N, written aside and renamed whole (:meth:`Checkpointer.save_final`).
        A run resumed from the checkpoint at that epoch's end writes it again, so a kill between the two leaves none
        missing."""
        n = state.epoch + 1
        self.checkpointer.save_final(self.out / f"epoch_{n}", dump_yaml(self.cfg), f"the model of epoch {n}")

    def _save(self, state: TrainState) -> Path:
        state.algo = self.algo.state_dict()
        if self.stream is not None:
            state.stream = comm.all_gather_object(self.stream.state())
        return self.checkpointer.save(state)
