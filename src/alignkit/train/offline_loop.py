"""The offline training loop shared by every offline algorithm.

Per optimizer step: take the step's micro-batches (``gradient_accumulation_steps`` of them,
fewer only at an epoch's end), count their loss units (tokens or sequences) and all-reduce the
count, so each micro-batch loss is ``sum / (global units / dp_size)`` and DDP's gradient
averaging yields exactly the global mean (ALGORITHMS 6.1). Gradients sync only on the last
micro-batch (``no_sync``). The LR schedule counts optimizer steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from alignkit.algorithms.base import MetricSums, OfflineAlgorithm
from alignkit.config import RunConfig, dump_yaml, resolve_batch, scaled_learning_rate
from alignkit.data.sampler import EvalSampler, ShardedSampler
from alignkit.distributed import comm
from alignkit.errors import DataError
from alignkit.logging import RunLogger, peak_memory_mb
from alignkit.models.loading import count_parameters, hf_model
from alignkit.train import checkpoint as ckpt
from alignkit.train.optim import build_optimizer, build_scheduler


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    micro_in_epoch: int = 0  # micro-batches of this epoch already consumed
    algo: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainResult:
    final_dir: Path | None
    metrics: dict[str, float]
    eval_metrics: dict[str, float]
    losses: list[float]


def plan_steps(n_examples: int, per_device: int, accumulation: int, world: int, t: Any) -> tuple[int, int, int]:
    """(micro-batches per epoch per rank, optimizer steps per epoch, total optimizer steps)."""
    per_rank = n_examples // world
    if per_rank == 0:
        raise DataError(f"the training set has {n_examples} examples, fewer than the {world} processes")
    micro = math.ceil(per_rank / per_device)
    per_epoch = math.ceil(micro / accumulation)
    total = t.max_steps if t.max_steps is not None else max(1, math.ceil(per_epoch * t.epochs))
    return micro, per_epoch, total


class OfflineTrainer:
    def __init__(self, cfg: RunConfig, algo: OfflineAlgorithm, strategy: Any, logger: RunLogger) -> None:
        self.cfg, self.algo, self.strategy, self.log = cfg, algo, strategy, logger
        self.out = Path(cfg.output_dir)
        self.plan = resolve_batch(cfg, strategy.dp_size)

    # ------------------------------------------------------------------ data
    def _train_loader(self, sampler: ShardedSampler) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.plan.per_device,
            sampler=sampler,
            collate_fn=self.algo.collate,
            num_workers=self.cfg.data.num_workers,
            drop_last=False,
        )

    def _micro_batches(self, state: TrainState) -> Iterator[tuple[list[dict[str, torch.Tensor]], bool]]:
        """Yields (the micro-batches of one optimizer step, whether the epoch ended with it)."""
        ga = self.plan.accumulation
        while True:
            self.sampler.set_epoch(state.epoch, start=state.micro_in_epoch * self.plan.per_device)
            it = iter(self._train_loader(self.sampler))
            group: list[dict[str, torch.Tensor]] = []
            for batch in it:
                group.append(batch)
                state.micro_in_epoch += 1
                if len(group) == ga:
                    ended = state.micro_in_epoch >= self.micro_per_epoch
                    yield group, ended
                    group = []
                    if ended:
                        break
            if group:
                yield group, True
            state.epoch += 1
            state.micro_in_epoch = 0

    # ------------------------------------------------------------------ main
    def fit(self) -> TrainResult:
        cfg, algo, strategy, log = self.cfg, self.algo, self.strategy, self.log
        t = cfg.training
        self.train_set = algo.build_dataset(cfg.data.train, "train")
        self.eval_set = algo.build_dataset(cfg.data.eval, "eval") if cfg.data.eval else []
        if algo.skipped.get("train"):
            log.info(f"Skipped {algo.skipped['train']} invalid or empty training rows (data.skip_invalid)")
        self.micro_per_epoch, per_epoch, total = plan_steps(
            len(self.train_set), self.plan.per_device, self.plan.accumulation, strategy.dp_size, t
        )
        self.sampler = ShardedSampler(len(self.train_set), strategy.dp_size, strategy.dp_rank, seed=t.seed)
        lr = scaled_learning_rate(cfg, self.plan)

        policy = algo.build_policy(strategy.policy_dtype(lora=cfg.model.lora is not None))
        trainable, n_total = count_parameters(policy)
        if cfg.model.lora is not None:
            log.info(
                f"LoRA enabled for policy model: {trainable:,} trainable / {n_total:,} total parameters "
                f"({100 * trainable / n_total:.2f}%)"
            )
        else:
            log.info(f"Policy model: {n_total:,} parameters ({trainable:,} trainable)")
        model, optimizer = strategy.prepare(policy, lambda m: build_optimizer(m, t, lr))
        self.frozen = algo.build_frozen(strategy)
        algo.before_training(model, self.train_set, self.eval_set, strategy)
        scheduler = build_scheduler(optimizer, t, total)
        log.info(
            f"Effective batch size: {self.plan.global_batch} (per_device={self.plan.per_device} x "
            f"accumulation={self.plan.accumulation} x {strategy.dp_size} processes)"
        )
        log.info(
            f"Training: {len(self.train_set)} examples, {per_epoch} optimizer steps per epoch, {total} steps in all, "
            f"lr={lr:.3g} ({t.lr_scheduler}), dtype={str(strategy.compute_dtype).replace('torch.', '')}"
        )

        state = TrainState()
        if strategy.is_main:
            ckpt.clean_stale(self.out)
        resume = ckpt.resolve_resume(self.out, cfg.checkpoint.resume_from)
        if resume is not None:
            saved = ckpt.load_checkpoint(resume, strategy=strategy, model=model, optimizer=optimizer, scheduler=scheduler)
            state = TrainState(saved["step"], saved["epoch"], saved["micro_in_epoch"], saved.get("algo", {}))
            algo.load_state_dict(state.algo)
            log.info(f"Resumed from {resume} at step {state.step} (epoch {state.epoch})")
        elif cfg.checkpoint.resume_from == "latest":
            log.info(f"No checkpoint in {self.out} yet; starting from scratch")

        losses: list[float] = []
        last_metrics: dict[str, float] = {}
        eval_metrics: dict[str, float] = {}
        window = _Window()
        log.start_progress(total, initial=state.step)
        batches = self._micro_batches(state)
        model.train()
        while state.step < total:
            group, _ = next(batches)
            step_loss, sums, tokens = self._optimizer_step(model, group)
            grad_norm = strategy.step(model, optimizer, t.max_grad_norm)
            current_lr = scheduler.get_last_lr()[0]
            scheduler.step()
            state.step += 1
            loss_value = comm.all_reduce_sum(torch.tensor(step_loss, dtype=torch.float64)).item() / strategy.dp_size
            losses.append(loss_value)
            window.add(loss_value, sums, tokens)
            extra = algo.on_step_end(state.step, {"loss": loss_value})
            log.advance({"loss": loss_value})
            if state.step % cfg.logging.logging_steps == 0 or state.step == total:
                last_metrics = self._log_window(window, state, per_epoch, current_lr, grad_norm, extra)
            if self.eval_set and t.eval_steps and state.step % t.eval_steps == 0 and state.step < total:
                eval_metrics = self.evaluate(model)
                log.log_metrics(state.step, eval_metrics, prefix="eval/")
            if cfg.checkpoint.save_steps and state.step % cfg.checkpoint.save_steps == 0 and state.step < total:
                self._save(model, optimizer, scheduler, state)
        final_dir = None
        if self.eval_set:
            eval_metrics = self.evaluate(model)
            log.log_metrics(state.step, eval_metrics, prefix="eval/")
        if cfg.checkpoint.save_steps:
            self._save(model, optimizer, scheduler, state)
        if cfg.checkpoint.save_final:
            final_dir = self.out / "final"
            strategy.save_model(model, final_dir, self.algo.tokenizer)
            if strategy.is_main:  # how it was trained (e.g. `alignkit score` reads the data format), as in checkpoints
                (final_dir / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
            log.info(f"Saved final model to {final_dir}")
        log.close()
        return TrainResult(final_dir, last_metrics, eval_metrics, losses)

    def _optimizer_step(self, model: torch.nn.Module, group: list[dict[str, torch.Tensor]]) -> tuple[float, MetricSums, int]:
        strategy, algo = self.strategy, self.algo
        units = torch.tensor(float(sum(algo.loss_units(b) for b in group)), dtype=torch.float64)
        global_units = comm.all_reduce_sum(units.to(strategy.device)).item()
        normalizer = max(global_units, 1.0) / strategy.dp_size
        total_loss = 0.0
        sums = MetricSums()
        tokens = 0
        for i, batch in enumerate(group):
            batch = {k: v.to(strategy.device, non_blocking=True) for k, v in batch.items()}
            last = i == len(group) - 1
            with (strategy.no_sync(model) if not last else _null()):
                with strategy.autocast():
                    loss, m = algo.loss(model, batch, normalizer=normalizer)
                strategy.backward(loss, model)
            total_loss += float(loss.detach())
            sums.merge(m)
            tokens += algo.tokens_in(batch)
        return total_loss, sums, tokens

    def _log_window(
        self, window: "_Window", state: TrainState, per_epoch: int, lr: float, grad_norm: float, extra: dict[str, float]
    ) -> dict[str, float]:
        strategy = self.strategy
        reduced = comm.reduce_metrics(window.sums.sums, window.sums.counts)
        tokens = comm.all_reduce_sum(torch.tensor(float(window.tokens), dtype=torch.float64).to(strategy.device)).item()
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        mem = comm.all_reduce_max(torch.tensor(peak_memory_mb(strategy.device.type)).to(strategy.device)).item()
        metrics = {
            "epoch": state.epoch + state.micro_in_epoch / max(1, self.micro_per_epoch),
            "loss": sum(window.losses) / len(window.losses),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens / elapsed,
            "peak_mem_mb": mem,
            **reduced,
            **extra,
        }
        self.log.log_metrics(state.step, metrics)
        window.reset()
        return metrics

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        strategy, algo = self.strategy, self.algo
        sampler = EvalSampler(len(self.eval_set), strategy.dp_size, strategy.dp_rank)
        loader = DataLoader(
            self.eval_set,
            batch_size=self.cfg.training.eval_batch_size or self.plan.per_device,
            sampler=sampler,
            collate_fn=algo.collate,
        )
        was_training = model.training
        model.eval()
        sums = MetricSums()
        # Sharded engines (FSDP2, ZeRO-3) gather weights inside forward, so every rank must run
        # as many forwards as the busiest one: ranks with fewer eval batches run discarded extras.
        most = int(comm.all_reduce_max(torch.tensor(float(len(loader)), device=strategy.device)).item())
        for batch in loader:
            batch = {k: v.to(strategy.device) for k, v in batch.items()}
            with strategy.autocast():
                sums.merge(algo.eval_step(model, batch))
        if most > len(loader):
            filler = {k: v.to(strategy.device) for k, v in algo.collate([self.eval_set[0]]).items()}
            for _ in range(most - len(loader)):
                with strategy.autocast():
                    algo.eval_step(model, filler)
        model.train(was_training)
        return comm.reduce_metrics(sums.sums, sums.counts)

    def _save(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, state: TrainState) -> None:
        state.algo = self.algo.state_dict()
        trainer_state = {
            "step": state.step,
            "epoch": state.epoch,
            "micro_in_epoch": state.micro_in_epoch,
            "algo": state.algo,
            "world_size": self.strategy.dp_size,
        }
        path = ckpt.save_checkpoint(
            self.out,
            state.step,
            strategy=self.strategy,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            trainer_state=trainer_state,
            config_yaml=dump_yaml(self.cfg),
            tokenizer=self.algo.tokenizer,
            save_total_limit=self.cfg.checkpoint.save_total_limit,
        )
        self.log.info(f"Saved checkpoint {path}")


class _Window:
    """Metrics accumulated between two log lines."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[float] = []
        self.sums = MetricSums()
        self.tokens = 0
        self.start = time.perf_counter()

    def add(self, loss: float, sums: MetricSums, tokens: int) -> None:
        self.losses.append(loss)
        self.sums.merge(sums)
        self.tokens += tokens


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


__all__ = ["OfflineTrainer", "TrainResult", "TrainState", "plan_steps", "hf_model"]
