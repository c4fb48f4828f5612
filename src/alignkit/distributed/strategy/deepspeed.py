"""DeepSpeed ZeRO 0-3 (optional extra: ``pip install 'alignkit[deepspeed]'``).

The engine keeps alignkit's semantics:
- The loop already divides each micro-batch loss by (global units / dp_size), so backward runs
  with ``scale_wrt_gas=False`` (DeepSpeed would divide by the accumulation steps again).
- The accumulation boundary is set explicitly on every backward: False inside the loop's
  ``no_sync`` (not the last micro-batch), True otherwise; ``engine.step()`` runs once per
  optimizer step. Gradients are summed over micro-batches and averaged over ranks like DDP,
  even for the shorter last group of an epoch.
- The optimizer is a torch AdamW from ``training.*`` (no fused_adam / cpu_adam JIT builds);
  DeepSpeed re-points its param groups at the fp32 partitions, so the LR schedule drives it.
- Clipping is DeepSpeed's ``gradient_clipping`` = ``training.max_grad_norm`` (see
  deepspeed_config.py); the returned grad norm is the engine's.
Checkpoints: ``engine.save_checkpoint`` inside the checkpoint directory plus a Hugging Face
export (ZeRO-3 weights gathered to rank 0 first).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from alignkit.config.loader import BatchPlan
from alignkit.distributed import comm
from alignkit.distributed.strategy.base import Handle, OptimizerFactory, Strategy
from alignkit.distributed.strategy.deepspeed_config import (
    build_deepspeed_config,
    fill_model_sizes,
    frozen_model_config,
    offloads_params,
)
from alignkit.distributed.strategy.deepspeed_group import use_trainers_group
from alignkit.distributed.strategy.sharded import ensure_process_group, save_hf_state_dict
from alignkit.errors import ConfigError
from alignkit.models.loading import hf_model, split_lm

DS_DIR = "deepspeed"  # engine.save_checkpoint output inside a checkpoint directory
DS_TAG = "state"


def import_deepspeed() -> Any:
    try:
        return importlib.import_module("deepspeed")
    except ImportError as e:
        raise ConfigError(
            f"distributed.strategy=deepspeed needs DeepSpeed, which is not importable ({e}); "
            "install it with: DS_BUILD_OPS=0 pip install 'alignkit[deepspeed]'"
        ) from None


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ds_config: dict[str, Any] = {}

    def configure(self, batch: BatchPlan, max_grad_norm: float) -> None:
        import_deepspeed()  # a missing install fails here, before any process group exists
        self.ds_config = build_deepspeed_config(
            self.cfg.deepspeed,
            per_device=batch.per_device,
            accumulation=batch.accumulation,
            world_size=self.env.world_size,
            max_grad_norm=max_grad_norm,
            dtype=self.compute_dtype,
        )
        super().configure(batch, max_grad_norm)  # its checks need the ZeRO stage

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    @property
    def label(self) -> str:
        return f"deepspeed zero_stage {self.zero_stage}"

    def frozen_plan(self) -> str | None:
        if self.zero_stage != 3:
            return None
        return "zero3_offload" if offloads_params(self.ds_config) else "zero3"

    def setup(self) -> None:
        ds = import_deepspeed()
        if self.device.type == "cpu":
            # DeepSpeed JIT-compiles a shared-memory comm op for CPU (about 60 s on 2 cores, once
            # per cache dir). gloo does the collectives without it. `import deepspeed.comm.torch as
            # m` would bind the torch package, hence importlib.
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        # DeepSpeed's deprecated collective calls warn on every use; nothing a user can act on.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        super().setup()
        ensure_process_group(self.backend, self.cfg.timeout_minutes)
        os.environ.setdefault("LOCAL_RANK", str(self.env.local_rank))  # a plain `python` run has none
        ds.init_distributed(dist_backend=self.backend, auto_mpi_discovery=False)
        if comm.group() is not None:  # rollout.placement: separate: the trainers' group is DeepSpeed's world
            use_trainers_group(comm.group())

    # ------------------------------------------------------------------ models
    def policy_dtype(self, *, lora: bool) -> torch.dtype:
        return torch.float32  # the engine casts the module to its bf16/fp16 itself and keeps fp32 master weights

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, role: str = "policy") -> Handle:
        ds = import_deepspeed()
        config = self._sized(self.ds_config, model)
        if self.zero_stage == 3:
            self._register_lm_head(ds, model)
        optimizer = make_optimizer(model)
        engine, _, _, _ = ds.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
        # The client optimizer's param groups are the ones DeepSpeed steps (pointed at its fp32
        # partitions), so the loop's LR scheduler works on it unchanged.
        return Handle(role, engine, optimizer, engine=engine)

    def shard_frozen_model(self, model: nn.Module) -> nn.Module:
        """An inference-only ZeRO-3 engine of its own (no optimizer; parameters partitioned over the
        ranks and gathered per module in forward, as TRL's ``prepare_deepspeed`` does for its
        reference). Returns the engine; its ``eval()`` puts the wrapped module in eval mode."""
        ds = import_deepspeed()
        self._register_lm_head(ds, model)
        config = self._sized(frozen_model_config(self.ds_config), model)
        engine, _, _, _ = ds.initialize(model=model, config=config, dist_init_required=False)
        engine.eval()
        return engine

    @staticmethod
    def _sized(config: dict[str, Any], model: nn.Module) -> dict[str, Any]:
        """``config`` with its "auto" ZeRO bucket sizes filled from the model's hidden size."""
        return fill_model_sizes(config, getattr(getattr(hf_model(model), "config", None), "hidden_size", None))

    @staticmethod
    def _register_lm_head(ds: Any, model: nn.Module) -> None:
        """ZeRO-3 gathers a parameter around its own module's forward; CausalLMLogps uses the LM
        head weight directly. DeepSpeed also fetches such a parameter on attribute access (checked:
        same result without this), but declaring it ties the gather to the root's forward."""
        try:
            _, head = split_lm(hf_model(model))
        except TypeError:
            return
        for p in head.parameters(recurse=False):
            ds.zero.register_external_parameter(model, p)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    @contextlib.contextmanager
    def full_params(self, module: nn.Module) -> Iterator[nn.Module]:
        """ZeRO-3: every parameter gathered once, and the engine's per-module fetch/release hooks
        lifted for the duration (DeepSpeed's ``unwrap_model_for_generation``), so ``generate`` runs
        on full weights without a collective per layer and token. Other stages hold full weights."""
        if getattr(module, "zero_optimization_partition_weights", lambda: False)():
            from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

            with unwrap_model_for_generation(module) as engine:
                yield self.unwrap(engine)
        else:
            yield self.unwrap(module)

    @contextlib.contextmanager
    def gathered(self, tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """ZeRO-3: the partitioned parameters among ``tensors`` gathered together (every rank takes part) and
        released after; other stages hold them whole."""
        params = [t for t in tensors if hasattr(t, "ds_id")]
        if not params:
            yield [t.data for t in tensors]
            return
        with import_deepspeed().zero.GatheredParameters(params, modifier_rank=None):
            yield [t.data for t in tensors]

    def local_params(self, module: nn.Module) -> dict[str, torch.Tensor]:
        if self.zero_stage == 3:  # ZeRO-3 partitions each parameter: ds_tensor is this rank's flat partition
            return {n: p.ds_tensor.data for n, p in self.unwrap(module).named_parameters() if p.requires_grad}
        return super().local_params(module)

    def refresh_params(self, module: nn.Module) -> None:
        if self.zero_stage != 3:
            return
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        # ZeRO-3 keeps small ("persistent") parameters gathered between steps and re-gathers them from their
        # partitions only after a step: gather them again so the forward sees the partitions just written
        held = [p for p in self.unwrap(module).parameters() if p.ds_status == ZeroParamStatus.AVAILABLE]
        for p in held:
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        if held:
            held[0].all_gather(held)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the engine holds the module in the compute dtype

    def backward(self, loss: torch.Tensor, handle: Handle) -> None:
        # ``handle.sync`` is False inside no_sync: not the last micro-batch of the optimizer step
        handle.engine.set_gradient_accumulation_boundary(handle.sync)
        handle.engine.backward(loss, scale_wrt_gas=False)

    def new_scaler(self) -> None:
        return None  # DeepSpeed scales fp16 losses itself

    def scales_loss(self, handle: Handle) -> bool:
        # each handle's engine runs its own fp16 loss scaler, as the other engines' handles do
        return bool(self.ds_config.get("fp16", {}).get("enabled"))

    def clip(self, handle: Handle, max_grad_norm: float) -> None:
        return None  # the engine clips inside its step (gradient_clipping in its config)

    def finish_step(self, handle: Handle, norm: float, *, skip: bool = False) -> float:
        engine = handle.engine
        if skip:  # a non-finite loss on some rank: drop this step's gradients instead of stepping
            self._drop_gradients(engine)
            return float("nan")
        own_norm = None
        if self.zero_stage == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()):
            # Plain fp32 data parallel: the engine does not report a norm; grads are reduced by now.
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            own_norm = float(torch.nn.utils.get_total_norm(grads, 2.0)) if grads else 0.0
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        norm = engine.get_global_grad_norm()
        if own_norm is not None or norm is None:
            return own_norm if own_norm is not None else float("nan")
        return float(norm)

    @staticmethod
    def _drop_gradients(engine: Any) -> None:
        """Forget the accumulated (already reduced) gradients of this step without an update."""
        opt = engine.optimizer
        engine.zero_grad()
        if hasattr(opt, "zero_grad"):
            opt.zero_grad(set_to_none=True)
        for name in ("averaged_gradients",):  # ZeRO-1/2 keep the reduced partitions here until step()
            grads = getattr(opt, name, None)
            if isinstance(grads, dict):
                grads.clear()
        for group in getattr(opt, "single_partition_of_fp32_groups", []) or []:
            group.grad = None
        engine.set_gradient_accumulation_boundary(True)

    # ------------------------------------------------------------------ saving
    def save_model(self, handle: Handle, out_dir: Path, tokenizer: Any = None) -> None:
        """Full weights in the engine's module dtype; under ZeRO-3 gathered to rank 0 (all ranks call)."""
        engine = handle.engine
        if self.zero_stage == 3:
            sd = engine._zero3_consolidated_16bit_state_dict()  # collective; None off rank 0
        else:
            sd = engine.module.state_dict() if self.is_main else None
        if self.is_main:
            save_hf_state_dict(engine.module, sd, out_dir, tokenizer)
        self.barrier()

    def save_training_state(self, handle: Handle, out_dir: Path) -> None:
        """Model + every rank's optimizer partition through the engine; all ranks call."""
        handle.engine.save_checkpoint(str(out_dir / DS_DIR), tag=DS_TAG, save_latest=False)
        self.barrier()

    def load_training_state(self, handle: Handle, ckpt_dir: Path) -> None:
        path = ckpt_dir / DS_DIR
        if not (path / DS_TAG).is_dir():
            raise FileNotFoundError(
                f"{ckpt_dir}: no DeepSpeed training state ({DS_DIR}/{DS_TAG}/); "
                "it was not written with distributed.strategy=deepspeed"
            )
        loaded, _ = handle.engine.load_checkpoint(
            str(path), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise FileNotFoundError(f"{path}: DeepSpeed could not load the checkpoint")
