"""A run config's memory plan, and ``distributed.strategy: auto`` decided from it.

:mod:`alignkit.planner.plan` is pure arithmetic on model dimensions; this module reads a
:class:`RunConfig` into :class:`~alignkit.planner.plan.MemoryInputs` (what ``alignkit estimate``
prints) and asks the machine how much memory one rank has (what ``auto`` compares against).

How alignkit's runs map onto the estimator:

* compute dtype = ``model.dtype`` (``auto``: bf16 on GPUs, fp32 on CPU). Trainable weights stay fp32
  while autocast / FSDP mixed precision / DeepSpeed bf16 compute in the compute dtype, which the
  estimator counts as compute-dtype weights + an fp32 master copy (the same 16 bytes/param with AdamW).
* optimizer: torch AdamW (train/optim.py), fp32 states; ``training.optimizer_impl: auto`` is counted as
  train/optim.py resolves it: fused (no step temporary) in the ddp column (single / DDP), foreach (a
  state-sized temporary at step time) under the sharding engines.
* ``training.fused_layers`` (models/fused.py) is counted where it applies: an explicit single, ddp or fsdp
  strategy; ``strategy: auto`` is counted unfused (it may pick deepspeed), high by what the fusion saves.
* log-probs are computed in chunks (no ``(B, T, V)`` logits); the workload says how many sequences
  an example puts through the trainable model (2 for chosen + rejected in one forward).
* the models are the algorithm's :class:`~alignkit.models.roles.ModelSpec` s: the first trainable one
  is the policy (a ``scalar`` kind gets a score head), further trainable ones (a critic) count their
  weights, gradients and optimizer states; the ``reference`` role is a held copy, ``transient``
  (precomputed), the LoRA base (``shares``) or absent; every other frozen role (reward, cost, ...)
  plus ``alignkit estimate --frozen`` is a frozen model held in the compute dtype. No algorithm is
  named here.
* frozen models are counted sharded under the strategies that can shard them (plan.SHARDS_FROZEN)
  unless ``distributed.shard_frozen: false``: ``auto`` shards them exactly when replicated copies
  would not fit, so "fits" is judged with them sharded. The run itself decides with
  :func:`frozen_sharding` (replicated vs sharded estimate of its engine, against the device memory).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

from alignkit.config.loader import resolve_batch
from alignkit.config.schema import DistributedConfig, RunConfig
from alignkit.distributed.env import DistEnv
from alignkit.models.adapter_dirs import adapter_config, is_adapter_dir
from alignkit.models.diffusion import lora_targets
from alignkit.models.dims import resolve_dims
from alignkit.models.fused import fused_layers_on
from alignkit.models.kinds import KINDS
from alignkit.models.roles import ModelSpec, Workload
from alignkit.models.vlm import PARTS, is_vlm_source, part_params
from alignkit.ops.logprobs import chunk_rows
from alignkit.planner.activations import activation_bytes
from alignkit.planner.model_dims import PRESETS, ModelDims
from alignkit.planner.plan import (
    GB,
    MemoryInputs,
    choose_shard_frozen,
    choose_strategy,
    estimate,
    trainable_params,
)

#: peft module names -> the estimator's projection names
LORA_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
#: RSS of python + torch + transformers + alignkit before any model exists (measured ~0.3 GB)
CPU_PROCESS_BASELINE_BYTES = int(0.5e9)


# --------------------------------------------------------------------------- config -> inputs
def _lora(cfg: RunConfig) -> tuple[int, tuple[str, ...], float] | None:
    """(r, estimator targets, dropout) from ``model.lora`` or a LoRA adapter directory; None = full."""
    lora = cfg.model.lora
    if lora is not None:
        r, modules, dropout = lora.r, list(lora.target_modules), lora.dropout
    elif cfg.model.name_or_path and is_adapter_dir(cfg.model.name_or_path):
        ac = adapter_config(cfg.model.name_or_path)
        r, modules, dropout = int(ac.get("r", 8)), ac.get("target_modules") or [], float(ac.get("lora_dropout", 0.0))
    else:
        return None
    if modules == "all-linear" or "all-linear" in modules:
        return r, tuple(LORA_TARGETS.values()), dropout
    targets = tuple(dict.fromkeys(LORA_TARGETS[m.rsplit(".", 1)[-1]] for m in modules
                                  if m.rsplit(".", 1)[-1] in LORA_TARGETS))
    return (r, targets, dropout) if targets else None


def reference_kind(workload: Workload) -> str:
    """The estimator's reference kind: ``model`` | ``lora_base`` | ``precomputed`` | ``none``."""
    ref = next((s for s in workload.specs if s.role == "reference"), None)
    if ref is None:
        return "none"
    if ref.transient:
        return "precomputed"
    return "lora_base" if ref.shares is not None else "model"


def _kind_dims(spec: ModelSpec, trust_remote_code: bool) -> ModelDims:
    """The dimensions of ``spec``'s model as its kind's adapter reads them (models/kinds.py)."""
    return KINDS.get(spec.kind).dims(spec, trust_remote_code)


def _dims_of(spec: ModelSpec, trust_remote_code: bool) -> ModelDims:
    return with_vision(_kind_dims(spec, trust_remote_code), spec, trust_remote_code)[0]


def _pipeline_lora(cfg: RunConfig, spec: ModelSpec, dims: ModelDims) -> tuple[int, tuple[str, ...], float] | None:
    """(r, module-name targets, dropout) of a diffusion role's LoRA, resolved as ``add_lora`` resolves them."""
    lora = spec.lora_config or cfg.model.lora
    if not spec.lora or lora is None:
        return None
    names = [name for name, _ in dims.linear_shapes().items()]
    return lora.r, tuple(lora_targets(lora.target_modules, names)), lora.dropout


def _image_inputs(cfg: RunConfig, workload: Workload, spec: ModelSpec, dims: ModelDims, **common: Any) -> MemoryInputs:
    """MemoryInputs of a diffusion role's trained forward: MMDiT activations over image patches + text tokens."""
    if workload.image is None:
        raise ValueError(f"the algorithm gives no image shape for its diffusion role {spec.role!r}")
    lora = _pipeline_lora(cfg, spec, dims)
    return MemoryInputs(policy=dims, lora_r=lora[0] if lora else None, lora_targets=lora[1] if lora else (),
                        lora_dropout=lora[2] if lora else 0.0, activation="mmdit",
                        seq_len=dims.tokens_per_image(workload.image.resolution, workload.image.text_tokens),
                        image_tokens=dims.image_tokens(workload.image.resolution),
                        sequences_per_example=workload.image.copies, **common)


def _as_extra(inputs: MemoryInputs) -> ModelDims:
    """A further trained model's dims with its trained count (LoRA adapters) for the estimate's extra rows."""
    return replace(inputs.policy, trained_params=None if inputs.lora_r is None else trainable_params(inputs))


def with_vision(dims: ModelDims, spec: ModelSpec, trust_remote_code: bool) -> tuple[ModelDims, int]:
    """A vision-language model's dimensions with its vision tower and projector counted, and how many of
    its parameters stay frozen while it trains (the parts outside ``spec.train_parts``; a reward / cost
    model on a VLM trains its projector and language model). Text models: unchanged, 0."""
    if spec.kind == "diffusion" or spec.source in PRESETS or not is_vlm_source(spec.source, trust_remote_code):
        return dims, 0
    parts = part_params(spec.source, trust_remote_code)
    dims = replace(dims, n_params=dims.n_params + parts["vision_tower"] + parts["projector"])
    if not spec.trainable:
        return dims, 0
    trained = spec.train_parts or (PARTS if spec.kind == "vlm" else ("projector", "language_model"))
    return dims, sum(n for part, n in parts.items() if part not in trained)


def compute_dtype(cfg: RunConfig, device: str) -> str:
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    return "bf16" if device == "cuda" else "fp32"


def _weights_path(cfg: RunConfig, dtype: str, lora: bool, device: str) -> dict[str, bool]:
    """How the policy's weights compute: ``compute_weights`` for ``model.compute_weights: cast`` of a bf16 full
    fine-tune under the engines that hold whole models (single / ddp); else ``autocast`` over fp32 weights on a
    GPU there (LoRA and fp16 keep it). FSDP's mixed precision and DeepSpeed cast the module themselves: no fp32
    residual stream."""
    whole = cfg.distributed.strategy in ("auto", "single", "ddp")
    cast = dtype == "bf16" and whole and cfg.model.compute_weights == "cast" and not lora
    return {"compute_weights": cast, "autocast": device == "cuda" and dtype != "fp32" and whole and not cast}


def memory_inputs(cfg: RunConfig, workload: Workload, *, n_gpus: int, device: str = "cuda",
                  policy: ModelDims | None = None, frozen: Sequence[str] = (),
                  process_baseline_bytes: int = 0) -> MemoryInputs:
    """MemoryInputs for ``cfg``'s models (``workload``) on ``n_gpus`` ranks (module docstring).

    ``policy`` replaces the dimensions read from the first trainable spec (e.g. a preset);
    ``frozen`` adds reward/cost models (presets or local dirs) to the workload's.
    """
    trust = cfg.model.trust_remote_code
    first, *others = workload.trainable
    dtype = compute_dtype(cfg, device)
    batch = resolve_batch(cfg, n_gpus)
    common: dict[str, Any] = dict(param_dtype=dtype, master_weights_fp32=dtype != "fp32", optimizer="adamw",
                                  optimizer_state_dtype="fp32",
                                  optimizer_impl=cfg.training.optimizer_impl,
                                  gradient_checkpointing=cfg.model.gradient_checkpointing,
                                  fused_layers=fused_layers_on(cfg.training.fused_layers, cfg.distributed.strategy),
                                  per_device_batch=batch.per_device, n_gpus=n_gpus, device=device,
                                  accumulation=batch.accumulation,
                                  **_weights_path(cfg, dtype, first.lora, device))
    images = {s.role: _image_inputs(cfg, workload, s, _kind_dims(s, trust), **common)
              for s in workload.trainable if s.kind == "diffusion" and not (s is first and policy is not None)}
    dims = policy or (images[first.role].policy if first.role in images else _kind_dims(first, trust))
    if first.kind == "scalar" and dims.head == "lm":
        dims = dims.as_score_model()
    frozen_params = 0
    if policy is None and first.kind != "diffusion":
        dims, frozen_params = with_vision(dims, first, trust)
    frozen_dims = [_dims_of(s, trust) for s in workload.frozen if s.role != "reference"]
    for spec in frozen:
        d = resolve_dims(spec, trust)
        frozen_dims.append(d.as_score_model() if d.head == "lm" else d)
    lora = _lora(cfg) if first.lora and first.role not in images else None
    reference = reference_kind(workload)
    if reference == "lora_base" and lora is None and first.role not in images:
        reference = "none"  # an adapter dir we could not read: the base costs nothing extra anyway
    extra = {s.role: _dims_of(s, trust) for s in others}
    extra.update({role: _as_extra(inp) for role, inp in images.items() if role != first.role})
    shared: dict[str, Any] = dict(
        reference=reference, frozen_models=frozen_dims, extra_trainable=[extra[s.role] for s in others],
        extra_activation_bytes=sum(activation_bytes(i) for r, i in images.items() if r != first.role),
        shard_frozen=cfg.distributed.shard_frozen is not False, frozen_params=frozen_params,
        process_baseline_bytes=process_baseline_bytes if device == "cpu" else 0,
        reserved_fraction=workload.reserved_fraction if device == "cuda" else 0.0)
    if first.role in images:
        return replace(images[first.role], **shared)
    return MemoryInputs(
        policy=dims,
        lora_r=lora[0] if lora else None,
        lora_targets=lora[1] if lora else ("q", "k", "v", "o"),
        lora_dropout=lora[2] if lora else 0.0,
        seq_len=cfg.data.max_length,
        sequences_per_example=workload.sequences_per_example,
        chunked_logits=True,
        logits_chunk_rows=first.chunk_size or _chunk_rows(dims.vocab, device),
        **shared,
        **common,
    )


def _chunk_rows(vocab: int, device: str) -> int:
    """The LM head's rows per chunk when the algorithm leaves it to memory: the op's own rule."""
    return chunk_rows(max(1, vocab), device)


# --------------------------------------------------------------------------- device memory
@dataclass(frozen=True)
class DeviceMemory:
    """What one rank may use: a GPU's memory, or its share of the host's RAM on CPU."""

    device: str  # "cuda" | "cpu"
    bytes_per_rank: int
    note: str


def host_ram_bytes() -> int:
    """Physical RAM, capped by a cgroup (container) limit when there is one."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(limit_file, encoding="ascii").read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


def probe_device_memory(env: DistEnv) -> DeviceMemory:
    """The local GPU's total memory; on CPU, the host's RAM shared by this node's ranks.

    Totals, not "free right now": every rank must reach the same decision without talking to the
    others (the process group does not exist yet), and free memory differs from one instant to the
    next. The pre-flight check then confirms all ranks chose the same strategy.
    """
    import torch

    if torch.cuda.is_available():
        idx = env.local_rank % torch.cuda.device_count()
        total = int(torch.cuda.get_device_properties(idx).total_memory)
        return DeviceMemory("cuda", total, f"{total / GB:.1f} GB per GPU")
    total = host_ram_bytes()
    local = max(1, env.local_world_size)
    return DeviceMemory("cpu", total // local, f"{total / GB:.1f} GB host RAM / {local} local processes")


# --------------------------------------------------------------------------- auto
def strategy_for_plan(plan_name: str, device: str, dist: DistributedConfig) -> tuple[str, DistributedConfig, str]:
    """Registered strategy + its settings for one of the estimator's strategies.

    zero2 -> DeepSpeed ZeRO-2 where DeepSpeed is importable (GPU), else FSDP2 without resharding after
    forward; zero3 -> DeepSpeed ZeRO-3, else FSDP2 resharding; zero3_offload adds CPU offload. CPU
    runs always use FSDP2 (DeepSpeed on CPU adds nothing here and JIT-builds ops).
    """
    if plan_name == "ddp":
        return "ddp", dist, "ddp"
    stage = 2 if plan_name == "zero2" else 3
    offload = plan_name == "zero3_offload"
    if device == "cuda" and importlib.util.find_spec("deepspeed") is not None:
        ds = dataclasses.replace(dist.deepspeed, zero_stage=stage, offload_optimizer=offload, offload_param=offload)
        return "deepspeed", dataclasses.replace(dist, deepspeed=ds), (
            f"deepspeed zero_stage={stage}" + (" + CPU offload" if offload else ""))
    fs = dataclasses.replace(dist.fsdp, reshard_after_forward=stage == 3, cpu_offload=offload)
    return "fsdp", dataclasses.replace(dist, fsdp=fs), (
        f"fsdp reshard_after_forward={'true' if stage == 3 else 'false'}" + (" + cpu_offload" if offload else ""))


def auto_strategy(cfg: RunConfig, env: DistEnv, workload: Workload, memory: DeviceMemory | None = None,
                  ) -> tuple[str, str, DistributedConfig]:
    """``distributed.strategy: auto`` under several processes: (strategy, why, distributed settings).

    The cheapest-communication strategy whose estimate fits the device memory (90% headroom): ddp,
    then ZeRO-2-like, ZeRO-3-like (and ZeRO-3 + offload on GPUs); diffusion pipelines included. An estimate
    that cannot be made (an unreachable hub id, an unknown architecture) falls back to ddp and says why.
    """
    memory = memory or probe_device_memory(env)
    try:
        baseline = CPU_PROCESS_BASELINE_BYTES if memory.device == "cpu" else 0
        inputs = memory_inputs(cfg, workload, n_gpus=env.world_size, device=memory.device,
                               process_baseline_bytes=baseline)
    except ValueError as e:
        return "ddp", f"auto: {env.world_size} processes; no memory estimate ({e}) -> ddp", cfg.distributed
    choices = ("ddp", "zero2", "zero3") + (("zero3_offload",) if memory.device == "cuda" else ())
    pick, why = choose_strategy(inputs, memory.bytes_per_rank, available=choices)
    name, dist, engine = strategy_for_plan(pick, memory.device, cfg.distributed)
    if memory.device == "cpu":
        why = why.replace("/GPU", "/process")
    return name, f"auto: {env.world_size} processes, {memory.note}; {why}" + (f" = {engine}" if pick != "ddp" else ""), dist


# --------------------------------------------------------------------------- frozen models
def frozen_roles(workload: Workload) -> list[str]:
    """The roles ``strategy.prepare_frozen`` will hold in this run (a transient reference included:
    it is loaded while the policy is already placed)."""
    return [s.role for s in workload.frozen]


def frozen_sharding(cfg: RunConfig, workload: Workload, plan_name: str, n_ranks: int,
                    memory: DeviceMemory) -> tuple[bool, str]:
    """``distributed.shard_frozen: auto`` for an engine whose memory the estimator calls ``plan_name``
    (fsdp, zero3, ...): :func:`~alignkit.planner.plan.choose_shard_frozen` on the run's estimate
    with the frozen models replicated vs sharded. A precomputing reference is counted as held."""
    try:
        baseline = CPU_PROCESS_BASELINE_BYTES if memory.device == "cpu" else 0
        inputs = memory_inputs(cfg, workload, n_gpus=n_ranks, device=memory.device, process_baseline_bytes=baseline)
    except ValueError as e:
        return False, f"no memory estimate ({e})"
    if inputs.reference == "precomputed":
        inputs = dataclasses.replace(inputs, reference="model")
    replicated, sharded = (estimate(dataclasses.replace(inputs, shard_frozen=s), plan_name) for s in (False, True))
    return choose_shard_frozen(replicated, sharded, memory.bytes_per_rank)


def describe(inputs: MemoryInputs) -> str:
    """One line naming what the estimate holds besides the policy."""
    d = inputs.policy
    head = {"score": "score head", "mmdit": "MMDiT transformer"}.get(d.head, "LM")
    parts = [f"policy {d.n_params / 1e9:.2f}B ({head})" + (f" + {d.frozen_parts / 1e9:.2f}B frozen VAE / text encoders"
                                                           if d.frozen_parts else ""),
             f"reference: {inputs.reference}"]
    if inputs.extra_trainable:
        parts.append(f"{len(inputs.extra_trainable)} more trainable model(s) of "
                     + ", ".join(f"{f.n_params / 1e9:.2f}B" for f in inputs.extra_trainable))
    if inputs.frozen_models:
        parts.append(f"{len(inputs.frozen_models)} frozen model(s) of "
                     + ", ".join(f"{f.n_params / 1e9:.2f}B" for f in inputs.frozen_models))
    parts.append(f"per-device batch {inputs.per_device_batch} x {inputs.sequences_per_example} seq x "
                 f"{inputs.seq_len} tokens" + (f" ({inputs.image_tokens} image patches + text)" if inputs.image_tokens else ""))
    if inputs.extra_activation_bytes:
        parts.append(f"+ {inputs.extra_activation_bytes / 1e9:.1f} GB activations of the other trained model(s)")
    return "; ".join(parts)
