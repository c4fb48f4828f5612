"""The one Strategy every engine implements (single device, DDP, FSDP2, DeepSpeed).

The training loops talk to the engine only through these methods, so no algorithm ever branches
on the engine. ``prepare`` returns a :class:`Handle` per trainable model; ``backward`` / ``step`` /
``no_sync`` / saving take a handle, so a run can train several models (actor and critic).
``full_params`` gathers a sharded model's parameters for generation. A Strategy receives its
settings as arguments (``distributed.*``, the batch plan, clipping), never the whole run config.
Engine quirks stay in each engine's own file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from abc import ABC, abstractmethod
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from alignkit.config.schema import DistributedConfig
from alignkit.distributed import comm
from alignkit.distributed.env import DistEnv
from alignkit.distributed.strategy import compute_weights as cw
from alignkit.errors import ConfigError
from alignkit.models.handle import Handle  # the record prepare returns; re-exported here, its users' old name
from alignkit.models.loading import hf_model
from alignkit.models.weights import load_weights_into
from alignkit.planner import auto

if TYPE_CHECKING:
    from alignkit.config.loader import BatchPlan
    from alignkit.planner.auto import DeviceMemory

log = logging.getLogger("alignkit")

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
#: (estimator strategy of this engine, ranks, device memory) -> (shard the frozen models?, why)
FrozenSharding = Callable[[str, int, "DeviceMemory"], tuple[bool, str]]


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_device(env: DistEnv) -> torch.device:
    """CUDA (this process's local GPU) when present, else CPU: the single-GPU / CPU fallback."""
    if torch.cuda.is_available():
        idx = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def pick_compute_dtype(requested: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where the GPU supports it, fp16 on older GPUs, fp32 on CPU."""
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def pick_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


class Strategy(ABC):
    """How the trainable model is placed, synchronised, stepped and saved."""

    name: str = "base"

    def __init__(self, cfg: DistributedConfig, env: DistEnv, dtype: str = "auto", *, auto_picked: bool = False,
                 compute_weights: str = "cast") -> None:
        """``cfg``: the resolved ``distributed`` settings; ``auto_picked``: ``strategy: auto`` chose
        this engine (then ``shard_frozen: true`` on an engine that cannot shard is a note, not an error);
        ``compute_weights``: ``model.compute_weights`` (cast: bf16 compute weights; autocast)."""
        self.compute_weights = compute_weights
        self.cfg = cfg
        self.env = env
        self.auto_picked = auto_picked
        self.device = pick_device(env)
        self.compute_dtype = pick_compute_dtype(dtype, self.device)
        self.backend = pick_backend(cfg.backend, self.device)
        self.shard_frozen = False  # whether prepare_frozen shards; decided by decide_frozen_sharding
        self.frozen_note = ""  # that decision in words, logged by rank 0 with the first frozen model

    def configure(self, batch: BatchPlan, max_grad_norm: float) -> None:
        """Run-wide numbers an engine may need beyond ``distributed.*`` (DeepSpeed: batch sizes and
        clipping). Called once before ``setup``; raise ConfigError here for conflicts."""
        if self.cfg.shard_frozen is True and self.frozen_plan() is None and not self.auto_picked:
            raise ConfigError(f"distributed.shard_frozen=true: {self.label} does not shard parameters; use fsdp or "
                              "deepspeed zero_stage 3, or set distributed.shard_frozen to auto or false")

    @property
    def label(self) -> str:
        """The engine in words, for messages (e.g. ``deepspeed zero_stage 2``)."""
        return self.name

    def frozen_plan(self) -> str | None:
        """The estimator's strategy (plan.py) for this engine where it can shard a frozen model
        (``fsdp``, ``zero3``, ...); None where every model stays whole on every rank."""
        return None

    # ------------------------------------------------------------------ process group
    @property
    def dp_rank(self) -> int:
        return self.env.rank

    @property
    def dp_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def setup(self) -> None:
        """Create the process group (once) when launched with several processes."""
        if self.env.world_size > 1 and not dist.is_initialized():
            kwargs: dict[str, Any] = {"backend": self.backend, "timeout": timedelta(minutes=self.cfg.timeout_minutes)}
            if self.device.type == "cuda":
                kwargs["device_id"] = self.device
            dist.init_process_group(**kwargs)

    def decide_frozen_sharding(self, frozen_roles: list[str], estimate: FrozenSharding | None = None) -> None:
        """Set ``self.shard_frozen`` once per run (``distributed.shard_frozen``), the same on every rank,
        and ``self.frozen_note`` (what was decided and why) when the run holds frozen models.
        ``estimate`` answers ``auto`` from the memory planner (the runner builds it from the specs)."""
        setting, plan = self.cfg.shard_frozen, self.frozen_plan()
        if plan is None:
            why = f"{self.label} does not shard parameters" + (
                "; distributed.shard_frozen=true is ignored" if setting is True else "")
            self.shard_frozen = False
        elif setting == "auto":
            self.shard_frozen, why = (self._auto_shard_frozen(plan, estimate)
                                      if frozen_roles and estimate is not None else (False, ""))
        else:
            self.shard_frozen, why = bool(setting), f"distributed.shard_frozen={str(setting).lower()}"
        if frozen_roles:
            self.frozen_note = f"Frozen models {'sharded' if self.shard_frozen else 'replicated'} " \
                               f"({' + '.join(frozen_roles)}: {why})"

    def _auto_shard_frozen(self, plan: str, estimate: FrozenSharding) -> tuple[bool, str]:
        memory = auto.probe_device_memory(self.env)  # looked up when called: a replaced probe is seen
        # Rank 0 alone decides, for the smallest device of all ranks; every rank takes its answer, so
        # the sharded forwards stay in lock-step even if another rank could not read the model config.
        smallest = -int(comm.all_reduce_max(torch.tensor(-memory.bytes_per_rank, dtype=torch.int64)).item())
        decision = None
        if self.is_main:
            decision = estimate(plan, self.dp_size, dataclasses.replace(memory, bytes_per_rank=smallest))
        return comm.broadcast_object(decision)

    def barrier(self) -> None:
        comm.barrier()  # the data-parallel group: generator ranks of a separate placement are not in it

    # ------------------------------------------------------------------ models
    @abstractmethod
    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, role: str = "policy") -> Handle:
        """Place/wrap a trainable model and build its optimizer (and its loss scaler: :meth:`new_scaler`)."""

    def place(self, model: nn.Module, make_optimizer: OptimizerFactory, role: str,
              wrap: Callable[[nn.Module], nn.Module] = lambda m: m) -> Handle:
        """A whole-model handle (single, DDP): ``model`` on the device, wrapped by ``wrap`` (DDP), its optimizer
        and scaler; or, with bf16 compute weights (:mod:`~alignkit.distributed.strategy.compute_weights`), the fp32
        model as the masters the optimizer steps and a bf16 copy that computes (not wrapped: the engine reduces
        the fp32 master gradients itself, :meth:`reduce_master_grads`)."""
        model = model.to(self.device)
        if not cw.eligible(model, self.compute_dtype, self.compute_weights):
            return Handle(role, wrap(model), make_optimizer(model), scaler=self.new_scaler())
        self.sync_masters(model)
        master, compute = cw.split(model, self.compute_dtype)
        return Handle(role, compute, make_optimizer(master), master=master)

    def sync_masters(self, master: nn.Module) -> None:
        """Make every rank's master weights rank 0's before training (what DDP's constructor does)."""

    def reduce_master_grads(self, handle: Handle) -> None:
        """Average the fp32 master gradients of ``handle`` over the ranks (after the last micro-batch)."""

    def new_scaler(self) -> torch.amp.GradScaler | None:
        """A fresh loss scaler for one trainable model: fp16 needs loss scaling, bf16 and fp32 do not."""
        return torch.amp.GradScaler(self.device.type) if self.compute_dtype == torch.float16 else None

    def policy_dtype(self, *, lora: bool) -> torch.dtype:
        """The dtype a trainable model is loaded in: fp32 master weights, except that a LoRA
        policy's frozen base is held in the compute dtype (bf16 on GPUs) with fp32 adapters;
        autocast computes in the compute dtype either way."""
        return self.compute_dtype if lora else torch.float32

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """A frozen model (reference, reward, cost): eval mode, no grads; replicated on every rank, so
        its forward has no collectives, or sharded (:meth:`shard_frozen_model`) when ``self.shard_frozen``."""
        if self.frozen_note and self.is_main:
            log.info(self.frozen_note)
        self.frozen_note = ""  # once per run
        model.eval()
        model.requires_grad_(False)
        return self.shard_frozen_model(model) if self.shard_frozen else model.to(self.device)

    def shard_frozen_model(self, model: nn.Module) -> nn.Module:
        """``model`` (eval mode, no grads) sharded over the ranks; every rank must then run its
        forwards in lock-step. Only engines with a :meth:`frozen_plan` get here."""
        raise NotImplementedError(f"{self.label} does not shard frozen models")

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if hasattr(model, "module") and isinstance(model, nn.Module) else model

    @contextlib.contextmanager
    def full_params(self, module: nn.Module) -> Iterator[nn.Module]:
        """Full parameters of ``module`` (a handle's module or a frozen model) for the duration, e.g.
        for generation: gathered ONCE on entry and released on exit (never per token or layer) by the
        sharding engines; a no-op where every rank holds the whole model. Yields the plain module
        to call (``generate``, forward), on every rank at the same time."""
        yield self.unwrap(module)

    @contextlib.contextmanager
    def gathered(self, tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """Some of a module's parameters (or buffers) whole for the duration, on every rank at the same time (a
        collective over the data-parallel group under the sharding engines, which override it): for sending them
        in buckets (``distributed/placement.py`` ``push_weights``). Here every rank holds them whole already."""
        yield [t.data for t in tensors]

    def local_params(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The storage this rank holds of ``module``'s trainable parameters by name (of the unwrapped module):
        tensors that share it (an in-place write changes the parameter), whole here, this rank's shard under the
        sharding engines. For elementwise state kept beside the weights (``models/ema.py``)."""
        return {n: p.data for n, p in self.unwrap(module).named_parameters() if p.requires_grad}

    def refresh_params(self, module: nn.Module) -> None:
        """After in-place writes into :meth:`local_params`, make ``module``'s forward see them (an engine that keeps
        a gathered copy beside the local storage re-gathers it); every rank calls. Nothing to do here."""

    # ------------------------------------------------------------------ step
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @contextlib.contextmanager
    def no_sync(self, handle: Handle) -> Iterator[None]:
        """Skip the gradient sync on accumulation micro-batches (engines override the mechanism)."""
        handle.sync = False
        try:
            yield
        finally:
            handle.sync = True

    def backward(self, loss: torch.Tensor, handle: Handle) -> None:
        if handle.scaler is not None:
            handle.scaler.scale(loss).backward()
        else:
            loss.backward()
        if handle.master is not None:
            cw.accumulate_grads(handle)  # fp32 accumulation over micro-batches

    def scales_loss(self, handle: Handle) -> bool:
        """Whether ``handle``'s fp16 loss scaler skips its overflowing steps itself (then a non-finite
        gradient norm of that handle is its business, not a non-finite step of the run)."""
        return handle.scaler is not None

    def clip(self, handle: Handle, max_grad_norm: float) -> torch.Tensor | None:
        """Unscale (fp16) and clip one handle's gradients; its global gradient norm before clipping as a
        device tensor (never read back here: the step code reads every role's norm in one transfer), or
        None when the engine clips inside its own step (DeepSpeed) or nothing has a gradient."""
        if handle.scaler is not None:
            handle.scaler.unscale_(handle.optimizer)
        if handle.master is not None:
            self.reduce_master_grads(handle)
        params = [p for p in handle.weights.parameters() if p.grad is not None]
        return self.clip_grads(params, max_grad_norm) if params else None

    def finish_step(self, handle: Handle, norm: float, *, skip: bool = False) -> float:
        """Step (unless ``skip``) and zero the grads of one handle after :meth:`clip`; returns its norm.

        ``skip`` (the loss was not finite on some rank) or a non-finite ``norm`` (the same on every rank:
        it is computed from the synchronised gradients) drops the update; the handle's fp16 scaler
        keeps its own overflow handling."""
        optimizer, scaler = handle.optimizer, handle.scaler
        if scaler is not None:
            if not skip:
                scaler.step(optimizer)  # skips by itself when the unscaled grads overflow
            scaler.update()
        elif not skip and math.isfinite(norm):
            optimizer.step()
            if handle.master is not None:
                cw.refresh_compute(handle)  # the one cast of the weights per optimizer step
        optimizer.zero_grad(set_to_none=True)
        return norm

    def clip_grads(self, params: list[torch.Tensor], max_grad_norm: float) -> torch.Tensor:
        """Global gradient norm of ``params``, clipping to ``max_grad_norm`` when it is > 0."""
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if max_grad_norm > 0:  # on the device: a clip coefficient clamped to 1, no read-back
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
        return norm

    # ------------------------------------------------------------------ saving
    def save_model(self, handle: Handle, out_dir: Path, tokenizer: Any = None) -> None:
        """Hugging Face format (safetensors), written by rank 0 only; every rank calls."""
        if self.is_main:
            inner = hf_model(self.unwrap(handle.weights))
            inner.save_pretrained(str(out_dir), safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(out_dir))
        self.barrier()

    def save_training_state(self, handle: Handle, out_dir: Path) -> None:
        """Optimizer (and the handle's scaler) state in ``out_dir`` (the role's own folder); rank 0
        only, since DDP replicas are identical."""
        if self.is_main:
            state = {"optimizer": handle.optimizer.state_dict()}
            if handle.scaler is not None:
                state["scaler"] = handle.scaler.state_dict()
            torch.save(state, out_dir / "optimizer.pt")
        self.barrier()

    def load_training_state(self, handle: Handle, ckpt_dir: Path) -> None:
        """Model weights and optimizer state from a checkpoint directory (every rank reads)."""
        load_weights_into(hf_model(self.unwrap(handle.weights)), ckpt_dir)
        if handle.master is not None:
            cw.refresh_compute(handle)
        state = torch.load(ckpt_dir / "optimizer.pt", map_location=self.device, weights_only=True)
        handle.optimizer.load_state_dict(state["optimizer"])
        # checkpoints from before per-handle scalers hold the shared scaler's state in every role's
        # folder under the same key: each role then starts from that one
        if handle.scaler is not None and "scaler" in state:
            handle.scaler.load_state_dict(state["scaler"])
