"""PyTorch FSDP2 (``fully_shard``): parameters, gradients and optimizer state sharded over ranks.

Each decoder block is one FSDP unit, then the root (embeddings, final norm, LM head). The LM
head weight is used only inside the root module's forward (``CausalLMLogps``), where FSDP2 has
it gathered. Gradients are reduce-scattered as averages over ranks on every backward and
accumulate in the sharded ``.grad`` across micro-batches: the same sum-over-micro-batches,
mean-over-ranks gradient as DDP, with ZeRO memory. Parameters are DTensors, so clipping reduces
the norm over shards. Checkpoints: sharded model + optimizer through torch.distributed.checkpoint
(DCP, resumable on another world size) plus a full Hugging Face export gathered on rank 0.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from alignkit.distributed import comm
from alignkit.distributed.strategy.base import Handle, OptimizerFactory, Strategy
from alignkit.distributed.strategy.sharded import decoder_blocks, ensure_process_group, save_hf_state_dict
from alignkit.errors import ModelError

DCP_DIR = "dcp"  # sharded model + optimizer inside a checkpoint directory


def _options(strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen weights (a LoRA base model) are not written: they come back from from_pretrained.
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


class FSDPStrategy(Strategy):
    name = "fsdp"

    def setup(self) -> None:
        # CausalLMLogps returns a view (the chunked log-probs reshaped); our losses never modify
        # it in place, which is the case this FSDP2 warning is about.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPCausalLMLogps\) returned a view")
        super().setup()
        ensure_process_group(self.backend, self.cfg.timeout_minutes)
        from torch.distributed.device_mesh import init_device_mesh

        group = comm.group()  # the trainers' group under rollout.placement: separate (generators are not in it)
        if group is not None:
            from torch.distributed.device_mesh import DeviceMesh

            self.mesh = DeviceMesh.from_group(group, self.device.type, mesh_dim_names=("dp",))
        else:
            self.mesh = init_device_mesh(self.device.type, (self.env.world_size,), mesh_dim_names=("dp",))

    # ------------------------------------------------------------------ models
    def _mp_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        o = self.cfg.fsdp
        if not o.mixed_precision or self.compute_weights == "autocast" or self.compute_dtype == torch.float32:
            return MixedPrecisionPolicy()
        reduce = torch.float32 if o.reduce_dtype == "fp32" else self.compute_dtype
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=reduce)

    def _shard(self, model: nn.Module, *, trainable: bool) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        o = self.cfg.fsdp
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if o.cpu_offload else OffloadPolicy()
        if not o.cpu_offload:
            model = model.to(self.device)
        kwargs: dict[str, Any] = {
            "mesh": self.mesh,
            # a frozen model has no backward to keep gathered parameters for
            "reshard_after_forward": o.reshard_after_forward or not trainable,
            # a frozen model computes in the dtype it was loaded in (algorithms load it in the compute dtype)
            "mp_policy": self._mp_policy() if trainable else MixedPrecisionPolicy(),
            "offload_policy": offload,
        }
        for block in decoder_blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def policy_dtype(self, *, lora: bool) -> torch.dtype:
        # fp32 for a LoRA base too: one FSDP unit holds one original dtype, and the
        # MixedPrecisionPolicy already gathers the (sharded) base in the compute dtype.
        return torch.float32

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, role: str = "policy") -> Handle:
        model = self._shard(model, trainable=True)
        # The optimizer is built over the DTensor shards, so its state is sharded too.
        return Handle(role, model, make_optimizer(model), scaler=self.new_scaler())

    def frozen_plan(self) -> str | None:
        o = self.cfg.fsdp
        return "zero3_offload" if o.cpu_offload else "fsdp" if o.reshard_after_forward else "fsdp_grad_op"

    def shard_frozen_model(self, model: nn.Module) -> nn.Module:
        """Sharded like the policy: one FSDP unit per decoder block, then the root."""
        return self._shard(model, trainable=False)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard keeps the module (its class becomes an FSDP subclass)

    @contextlib.contextmanager
    def full_params(self, module: nn.Module) -> Iterator[nn.Module]:
        """All-gather every FSDP unit of ``module`` once and keep it gathered until exit: forwards
        inside (e.g. ``generate`` step after step) then run on full weights without collectives.
        Resharding after forward is switched off for the duration and restored after."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if not units:
            yield module
            return
        # FSDP2 picks its root at the first forward; a generate call on the inner HF model would make an
        # inner unit the root and break the training forward after it: initialise from the real root
        units[0]._get_fsdp_state()._lazy_init()
        # FSDP2 keeps the per-unit setting on each unit's param group; off for the duration
        saved = [_reshard_setting(u) for u in units]
        for u in units:
            u.set_reshard_after_forward(False, recurse=False)
        handles = [u.unshard(async_op=True) for u in units]
        for h in handles:
            if h is not None:
                h.wait()
        try:
            yield module
        finally:
            for u, before in zip(units, saved):
                u.reshard()
                u.set_reshard_after_forward(before, recurse=False)

    @contextlib.contextmanager
    def gathered(self, tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """Each DTensor all-gathered over the mesh (every rank takes part), the others as they are."""
        from torch.distributed.tensor import DTensor

        yield [t.full_tensor() if isinstance(t, DTensor) else t.data for t in tensors]

    def local_params(self, module: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        # outside forward FSDP2's parameters are the sharded DTensors: their local tensor is this rank's shard
        return {n: p.to_local().data if isinstance(p, DTensor) else p.data
                for n, p in module.named_parameters() if p.requires_grad}

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self._mp_policy().param_dtype is not None:
            return contextlib.nullcontext()  # FSDP already computes in param_dtype
        return super().autocast()

    # ------------------------------------------------------------------ step
    def clip_grads(self, params: list[torch.Tensor], max_grad_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        # The norm of DTensor grads is a partial (per-shard) value; full_tensor() reduces it
        # over ranks before clipping, so every rank clips by the same global norm.
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm, foreach=True)
        return norm

    # ------------------------------------------------------------------ saving
    def save_model(self, handle: Handle, out_dir: Path, tokenizer: Any = None) -> None:
        """Full weights gathered to rank 0 (CPU), written with ``save_pretrained``; all ranks call."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        model = handle.module
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.is_main:
            save_hf_state_dict(model, sd, out_dir, tokenizer)
        self.barrier()

    def save_training_state(self, handle: Handle, out_dir: Path) -> None:
        """Each rank writes its own shards of the model and optimizer (DCP); all ranks call."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(handle.module, handle.optimizer, options=_options())
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out_dir / DCP_DIR), process_group=comm.group())
        if handle.scaler is not None and self.is_main:  # out_dir is the role's own folder
            torch.save({"scaler": handle.scaler.state_dict()}, out_dir / "scaler.pt")
        self.barrier()

    def load_training_state(self, handle: Handle, ckpt_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimizer = handle.module, handle.optimizer

        path = ckpt_dir / DCP_DIR
        if not path.is_dir():
            raise FileNotFoundError(
                f"{ckpt_dir}: no FSDP training state ({DCP_DIR}/); it was not written with distributed.strategy=fsdp"
            )
        # get_state_dict initialises the optimizer state, so DCP has tensors to load into.
        msd, osd = get_state_dict(model, optimizer, options=_options())
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path), process_group=comm.group())
        # strict=False only because frozen weights are absent on purpose; anything else missing is an error.
        result = set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_options(False)
        )
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        missing = [k for k in result.missing_keys if k not in frozen]
        if missing or result.unexpected_keys:
            unexpected = result.unexpected_keys[:3]
            raise ModelError(f"{path}: model state mismatch (missing {missing[:3]}, unexpected {unexpected})")
        if handle.scaler is not None and (ckpt_dir / "scaler.pt").is_file():
            handle.scaler.load_state_dict(torch.load(ckpt_dir / "scaler.pt", weights_only=True)["scaler"])


def _reshard_setting(unit: Any) -> bool:
    """The unit's current reshard-after-forward setting (FSDP2 keeps it on the unit's param group)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    return any(g is not None and g.post_forward_mesh_info is not None for g in groups)
