"""Step code shared by the offline loop and the online loop.

One optimizer step (ALGORITHMS 6.1): count the loss units (tokens or sequences) of the step's
micro-batches and all-reduce the count, so each micro-batch loss is ``sum / (global units / dp_size)``
and the engines' gradient averaging over ranks yields exactly the global mean; gradients sync only on
the last micro-batch (``no_sync``). The step reads the device back once: the losses (all-reduced) and the
gradient norms, which decide whether to step; metric sums stay on the device until a log line or a hook
reduces them (:mod:`alignkit.train.step_metrics`). The log line, the non-finite guard and checkpoint
save/resume live here too.
"""

from __future__ import annotations

import contextlib
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from alignkit.algorithms.base import Batch
from alignkit.config import BatchPlan
from alignkit.distributed import comm
from alignkit.distributed.comm import stack_on_one_device
from alignkit.distributed.strategy.base import Strategy
from alignkit.errors import TrainingError
from alignkit.logging import RunLogger
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models
from alignkit.train import checkpoint as ckpt
from alignkit.train.model_card import write_model_card
from alignkit.train.resume import check_same_run, fast_forward, schedule_changed
from alignkit.train.step_metrics import StepResult, Window

LossFn = Callable[..., tuple["torch.Tensor | dict[str, torch.Tensor]", MetricSums]]


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    consumed: int = 0  # examples of this epoch's global order already trained on (all ranks together)
    algo: dict[str, Any] = field(default_factory=dict)
    stream: list[dict[str, int]] | None = None  # data.streaming: every rank's stream position


def global_normalizer(local_units: float, strategy: Strategy) -> float:
    """``global units / dp_size``: what each micro-batch's summed loss is divided by. The units are counted
    by the host from the collated batches, so this never waits for the device."""
    (units,) = comm.all_reduce_host_sum([float(local_units)])
    return max(units, 1.0) / strategy.dp_size


def _role_losses(loss: torch.Tensor | dict[str, torch.Tensor], models: Models) -> dict[str, torch.Tensor]:
    return loss if isinstance(loss, dict) else {models.primary: loss}


def role_normalizers(units: list[dict[str, int]], roles: list[str], strategy: Strategy) -> dict[str, float]:
    """Per role, ``global units / dp_size`` of the step (one all-reduce of every role's count): for an algorithm
    whose micro-batches carry the losses of several roles counted in different units (flow_rtpo: attack
    sequences and (image, denoising step) pairs)."""
    total = comm.all_reduce_host_sum([float(sum(u.get(r, 0) for u in units)) for r in roles])
    return {r: max(t, 1.0) / strategy.dp_size for r, t in zip(roles, total)}


def accumulate(strategy: Strategy, models: Models, group: list[Batch], loss_fn: LossFn,
               units_fn: Callable[[Batch], int | dict[str, int]],
               tokens_fn: Callable[[Batch], int]) -> tuple[dict[str, torch.Tensor], MetricSums, int]:
    """Forward + backward of one optimizer step's micro-batches on this rank.

    ``units_fn`` gives a micro-batch's loss units, or ``{role: units}`` when roles count their own (the loss then
    gets ``{role: normalizer}``, and a role's gradients sync on the last micro-batch that holds its units, which
    is the same one on every rank since every rank holds the same layout of samples). Units and tokens are
    counted on the host batches, before they move to the device.
    Returns (this rank's summed loss per role, on the device; metric sums; tokens processed)."""
    units = [units_fn(b) for b in group]
    tokens = sum(tokens_fn(b) for b in group)
    last = {role: len(group) - 1 for role in models.handles}
    normalizer: float | dict[str, float]
    if units and isinstance(units[0], dict):
        per_role: list[dict[str, int]] = units  # type: ignore[assignment]
        normalizer = role_normalizers(per_role, list(models.handles), strategy)
        last = {role: max([i for i, u in enumerate(per_role) if u.get(role, 0) > 0], default=len(group) - 1)
                for role in models.handles}
    else:
        normalizer = global_normalizer(sum(units), strategy)  # type: ignore[arg-type]
    losses: dict[str, torch.Tensor] = {}
    sums = MetricSums()
    for i, batch in enumerate(group):
        batch = batch.to(strategy.device)
        with contextlib.ExitStack() as stack:
            for role, handle in models.handles.items():
                if i < last[role]:
                    stack.enter_context(strategy.no_sync(handle))
            with strategy.autocast():
                loss, m = loss_fn(models, batch, normalizer=normalizer)
            for role, value in _role_losses(loss, models).items():
                strategy.backward(value, models.handles[role])
                value = value.detach().to(torch.float64)
                losses[role] = losses[role] + value if role in losses else value
        sums.merge(m)
    return losses, sums, tokens


def optimizer_step(strategy: Strategy, models: Models, max_grad_norm: float,
                   losses: dict[str, torch.Tensor | float]) -> tuple[dict[str, float], bool, dict[str, float]]:
    """Clip, step and advance the LR schedule of every trainable role: (grad norms by role, whether the
    update was dropped as non-finite, every role's loss summed over ranks).

    This is the step's ONE read-back from the device: the losses (all-reduced) and every role's gradient
    norm travel to the host together, since whether to step depends on them. A non-finite loss on ANY rank
    or a non-finite gradient norm (identical on every rank) drops the update of every role on every rank;
    the step still counts and the schedule advances, so a resumed run stays aligned."""
    roles = list(models.handles)
    local = stack_on_one_device([torch.as_tensor(losses.get(r, 0.0), dtype=torch.float64) for r in roles])
    bad = (~torch.isfinite(local)).any().to(torch.float64).reshape(1)
    summed = comm.all_reduce_sum(torch.cat([bad, local]))  # a bad count > 0 anywhere: drop everywhere
    clipped = {role: strategy.clip(handle, max_grad_norm) for role, handle in models.handles.items()}
    norm_roles = [r for r in roles if clipped[r] is not None]
    host = stack_on_one_device(list(summed.unbind()) + [clipped[r] for r in norm_roles]).tolist()
    skip, role_sums = host[0] > 0, dict(zip(roles, host[1 : 1 + len(roles)]))
    found = dict(zip(norm_roles, host[1 + len(roles):]))
    norms = {}
    for role, handle in models.handles.items():
        norms[role] = strategy.finish_step(handle, found.get(role, 0.0), skip=skip)
        if handle.scheduler is not None:
            handle.scheduler.step()
    # a handle whose fp16 scaler skipped its overflowing step drops nothing else: the other roles stepped
    dropped = skip or any(not math.isfinite(norms[role]) and not strategy.scales_loss(handle)
                          for role, handle in models.handles.items())
    return norms, dropped, role_sums


class NonfiniteGuard:
    """``training.nonfinite``: stop at the first dropped step (``stop``), or after ``limit`` in a row
    (``skip``), with a one-line error naming the step; every dropped step is logged and counted."""

    def __init__(self, policy: str, limit: int, log: RunLogger) -> None:
        self.policy, self.limit, self.log = policy, limit, log
        self.in_a_row = 0
        self.total = 0

    def observe(self, step: int, result: StepResult) -> None:
        if not result.nonfinite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        norms = ", ".join(f"{r}={v:.3g}" for r, v in result.grad_norms.items())
        what = f"step {step}: the loss ({result.loss:.4g}) or gradient norm ({norms}) is not finite"
        if self.policy == "stop" or self.in_a_row >= self.limit:
            why = ("training.nonfinite=stop" if self.policy == "stop"
                   else f"{self.in_a_row} steps in a row (training.max_nonfinite_steps={self.limit})")
            error = TrainingError(f"{what}; stopping ({why}); the last checkpoint holds finite weights. Lower "
                                  "training.learning_rate, set training.max_grad_norm, or check the data")
            error.same_on_every_rank = True  # the decision is all-reduced: every rank stops at this step
            raise error
        self.log.info(f"{what}; optimizer step skipped ({self.in_a_row} in a row, {self.total} in all)")


def log_window(log: RunLogger, strategy: Strategy, window: Window, state: TrainState, epoch: float, lr: float,
               result: StepResult, extra: dict[str, float], headline: tuple[str, ...] = ()) -> dict[str, float]:
    """One log line / JSONL row for the window that ends at ``state.step``; resets the window."""
    w = window.metrics(strategy)
    norms = result.grad_norms
    first = next(iter(norms), None)
    metrics = {"epoch": epoch, "loss": w.pop("loss"), "lr": lr, "grad_norm": norms.get(first, 0.0) if first else 0.0,
               **{f"grad_norm/{r}": v for r, v in list(norms.items())[1:]}, **w, **extra}
    log.log_metrics(state.step, metrics, headline=headline)
    window.reset()
    return metrics


def consumed_of(saved: dict[str, Any], per_device: int) -> int:
    """Examples of the epoch already trained on; checkpoints written before the global order stored
    micro-batches per rank, which this converts (exact for the layout they were written with)."""
    if "consumed" in saved:
        return int(saved["consumed"])
    return int(saved.get("micro_in_epoch", 0)) * per_device * int(saved.get("world_size", 1))


def weights_finite(module: torch.nn.Module, strategy: Strategy) -> bool:
    """Whether every parameter (each rank's shard of it) is finite on every rank."""
    from torch.distributed.tensor import DTensor

    shards = (p.to_local() if isinstance(p, DTensor) else p for p in module.parameters())
    local = all(bool(torch.isfinite(t.detach()).all()) for t in shards if t.numel())
    flag = comm.all_reduce_max(torch.tensor(float(not local), device=strategy.device))
    return not bool(flag.item())


class Checkpointer:
    """Save and resume a run: every trainable role, its optimizer and schedule, the trainer state and
    the algorithm's state; written atomically by :mod:`alignkit.train.checkpoint`."""

    def __init__(self, out: Path, strategy: Strategy, models: Models, *, config_yaml: str, tokenizer: Any,
                 save_total_limit: int | None, log: RunLogger, batch: BatchPlan) -> None:
        self.out, self.strategy, self.models, self.batch = out, strategy, models, batch
        self.config_yaml, self.tokenizer, self.limit, self.log = config_yaml, tokenizer, save_total_limit, log
        self.resumed: Path | None = None
        self.saved: tuple[int, Path] | None = None  # (step, folder) of the last checkpoint this run wrote

    def tokenizer_of(self, role: str) -> Any:
        """The run's tokenizer for a trained role of the primary role's kind; None for one of another kind (flow_rtpo's
        image policy: a diffusers pipeline keeps its own tokenizers, the attacker's has no place in its folder)."""
        specs, primary = self.models.specs, self.models.primary
        if role in specs and primary in specs and specs[role].kind != specs[primary].kind:
            return None
        return self.tokenizer

    def save(self, state: TrainState, extra: Callable[[Path], None] | None = None) -> Path:
        bad = [role for role, h in self.models.handles.items() if not weights_finite(h.module, self.strategy)]
        if bad:  # cannot happen with the non-finite guard; a checkpoint must never carry NaN weights
            raise TrainingError(f"refusing to write checkpoint-{state.step}: the weights of {', '.join(bad)} are not "
                                f"finite; the previous checkpoint in {self.out} is intact")
        b = self.batch
        trainer_state = {"step": state.step, "epoch": state.epoch, "consumed": state.consumed, "algo": state.algo,
                         "world_size": b.world_size, "per_device": b.per_device, "accumulation": b.accumulation}
        if state.stream is not None:
            trainer_state["stream"] = state.stream
        path = ckpt.save_checkpoint(self.out, state.step, strategy=self.strategy, handles=self.models.handles,
                                    trainer_state=trainer_state, config_yaml=self.config_yaml,
                                    tokenizer={r: self.tokenizer_of(r) for r in self.models.handles},
                                    save_total_limit=self.limit, extra=extra)
        self.log.info(f"Saved checkpoint {path}")
        self.saved = (state.step, path)
        return path

    def resume(self, resume_from: str | None, *, weights_only: bool = False) -> TrainState:
        """The state to start from: a fresh one, or the checkpoint ``resume_from`` names, restored after
        checking that it was written by this same run (:mod:`alignkit.train.resume`)."""
        if self.strategy.is_main:
            ckpt.clean_stale(self.out)
        path = ckpt.resolve_resume(self.out, resume_from)
        self.resumed = None if weights_only else path  # the checkpoint the run continues (its algorithm files)
        if path is None or weights_only:
            if path is not None:
                self.log.info(f"Started a new run from the weights of {path} (checkpoint.resume_weights_only)")
            elif resume_from == "latest":
                self.log.info(f"No checkpoint in {self.out} yet; starting from scratch")
            return TrainState()
        rebuild = self._check_same_run(path)
        saved = ckpt.load_checkpoint(path, strategy=self.strategy, handles=self.models.handles,
                                     load_schedulers=not rebuild)
        if rebuild:
            for handle in self.models.handles.values():
                fast_forward(handle.scheduler, saved["step"])
            lr = self.models.handles[self.models.primary].scheduler.get_last_lr()[0]
            self.log.info(f"LR schedule rebuilt from the new settings at step {saved['step']} (lr now {lr:.3g})")
        self.log.info(f"Resumed from {path} at step {saved['step']} (epoch {saved['epoch']})")
        self._note_layout(saved)
        for name, dropped in self.log.rewind_metrics(saved["step"]).items():
            self.log.info(f"{name}: dropped {dropped} rows logged after step {saved['step']} by the interrupted run")
        return TrainState(saved["step"], saved["epoch"], consumed_of(saved, self.batch.per_device), saved.get("algo", {}),
                          saved.get("stream"))

    def _note_layout(self, saved: dict[str, Any]) -> None:
        """Say what changed when the run resumes with another batch layout or world size."""
        b, world = self.batch, int(saved.get("world_size", self.batch.world_size))
        old = (int(saved.get("per_device", b.per_device)), int(saved.get("accumulation", b.accumulation)), world)
        if old != (b.per_device, b.accumulation, b.world_size):
            self.log.info(f"Effective batch changed on resume: {old[0] * old[1] * old[2]} (per_device={old[0]} x "
                          f"accumulation={old[1]} x {old[2]} processes) -> {b.global_batch} (per_device={b.per_device} "
                          f"x accumulation={b.accumulation} x {b.world_size} processes); the epoch continues at "
                          f"example {consumed_of(saved, b.per_device)} of its order")
        if world != self.strategy.dp_size:
            self.log.info(f"RNG states: {world} saved, {self.strategy.dp_size} ranks now; rank r takes saved rank r's "
                          f"state where one exists, the others continue from the seed (dropout differs from an "
                          f"uninterrupted run)")

    def _check_same_run(self, path: Path) -> bool:
        """Refuse a checkpoint of another run; log each allowed change; True when the LR schedule changed."""
        allowed = check_same_run(path, self.config_yaml)
        for line in allowed:
            self.log.info(f"Resume with a changed setting, applied: {line}")
        return schedule_changed(allowed)

    def finish(self, save: Callable[[], Any], *, save_steps: int | None, save_final: bool,
               final_weights: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> Path | None:
        """The end of a run, for both loops: a last checkpoint (``save``) when checkpoints are on, then
        the final model in ``OUTPUT_DIR/final`` when ``save_final``, saved inside ``final_weights()`` (the weights
        the final model holds: an algorithm's EMA; the checkpoint keeps the trained ones); returns that folder
        (None without)."""
        if save_steps:
            save()
        if not save_final:
            return None
        final_dir = self.out / "final"
        with final_weights():
            self.save_final(final_dir, self.config_yaml)
        return final_dir

    def save_final(self, final_dir: Path, config_yaml: str, what: str = "final model") -> None:
        """The primary role's weights in ``final_dir`` (HF format), others in ``final_dir``_ROLE; the log line
        names ``what`` was saved (the final model, or an epoch's model)."""
        for i, (role, handle) in enumerate(self.models.handles.items()):
            target = final_dir if i == 0 else final_dir.with_name(f"{final_dir.name}_{role}")
            tmp = ckpt.tmp_dir(target)  # written aside, then renamed whole (a crash leaves no half folder)
            if self.strategy.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            self.strategy.save_model(handle, tmp, self.tokenizer_of(role))
            if self.strategy.is_main:  # how it was trained (e.g. `alignkit score` reads the data format)
                (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
                ckpt.put_in_place(tmp, target)
                spec = self.models.specs.get(role)  # what the role started from, named by its card
                write_model_card(target, config_yaml, self.out, source=spec.source if spec else None, what=what,
                                 role=None if i == 0 else role)
        self.log.info(f"Saved {what} to {final_dir}")
