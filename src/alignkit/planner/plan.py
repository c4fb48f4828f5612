"""Predict per-GPU memory before launch, and choose a distributed strategy from it.

Pure arithmetic on config numbers: no model is built, nothing touches ``torch.distributed``.
Units: bytes everywhere; tables print GB = 1e9 bytes (labelled), the unit of the seed guides.

Per-GPU components (``n`` = ``n_gpus``; ``P`` = policy params, ``P_t`` = trainable params):

====================  ===========================================================================
policy weights        ``P * bytes(param_dtype)`` (+ LoRA ``A``/``B`` in ``lora_dtype``); ``/n`` under
                      zero3/fsdp; on the host under zero3_offload. ``P_t = P - frozen_params`` for
                      full training (a VLM's frozen vision tower, or its LM in the pretrain stage).
master weights        ``P_t * 4`` when ``master_weights_fp32`` and the trainable dtype is not fp32.
gradients             ``P_t * bytes(trainable dtype)`` (fp32 on the host under zero3_offload).
optimizer states      ``P_t * n_states * bytes(optimizer_state_dtype)``; adamw/adam 2, sgd 1.
zero3 working set     gathered params of the current + prefetched unit and one unsharded gradient
                      unit (unit = max(decoder layer, embedding matrix)), zero3-family only.
reference / frozen    ``n_params * bytes(param_dtype)``; sharded ``/n`` only with ``shard_frozen`` under
                      a strategy whose engine shards parameters (:data:`SHARDS_FROZEN`).
activations           see :func:`activation_breakdown` (saved tensors of a Llama layer) for the largest
                      micro-batch the run draws (``drawn_tokens``, read off its data by ``alignkit estimate``)
                      or the worst case ``B x sequences x T``; ``autocast`` (the ddp column of a GPU run with
                      ``model.compute_weights: autocast``): fp32 weights under bf16 autocast, fp32 grads, fp32
                      residual stream.
compute weights       ``compute_weights`` (``model.compute_weights: cast``, the ddp column of a bf16 full
                      fine-tune): the bf16 compute copy is the policy weights row, the fp32 masters the master row,
                      the gradients fp32 (the masters'), the residual stream bf16, and the bf16 compute gradients
                      ``P_t * p`` a transient row (they live from backward until they are added into the fp32
                      ones; where gradients are transient those are created then too: ``+ P_t * 4``).
optimizer step temp   ``foreach`` (torch's CUDA default) materialises a state-sized tensor list
                      (``exp_avg_sq.sqrt()``); ``for_loop`` one parameter's worth; ``fused`` 0.
overhead              CUDA context + allocator fragmentation, 1.5 GB on cuda, 0 on cpu.
====================  ===========================================================================

ZeRO arithmetic follows Rajbhandari et al. 2020 (sec. 5): stage 1 shards optimizer states (the fp32
master copy is part of them), stage 2 also gradients, stage 3 also parameters. ``fsdp`` is treated as
ZeRO-3 (``reshard_after_forward=True``), ``fsdp_grad_op`` as ZeRO-2. Simplification: FSDP2 with bf16
``MixedPrecisionPolicy`` keeps only fp32 shards, so with master weights we over-count it by ``2P/n``.

Gradients are counted as persistent (DDP buckets with ``gradient_as_bucket_view``, ZeRO and FSDP keep
gradient buffers), so ``total = persistent rows + max(activations, optimizer step temp)``: the step
temporaries exist only after backward has freed the activations. Reference and reward/cost models run
under ``no_grad`` before the policy forward; their transient forward memory is not counted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from alignkit.errors import ConfigError
from alignkit.planner.activations import ACTIVATION_METHODS, DTYPE_BYTES, activation_bytes
from alignkit.planner.model_dims import ModelDims

GB = 10**9
GIB = 2**30
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_no_momentum": 0}
#: "auto" is alignkit's training.optimizer_impl: fused AdamW under single / DDP, foreach under the sharding engines
OPTIMIZER_IMPLS = ("fused", "foreach", "for_loop", "auto")
REFERENCE_KINDS = ("none", "model", "lora_base", "precomputed")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
CUDA_OVERHEAD_BYTES = int(1.5e9)
#: Cheapest communication first; ``choose_strategy`` returns the first one that fits.
COMM_ORDER = ("ddp", "zero1", "zero2", "fsdp_grad_op", "zero3", "fsdp", "zero3_offload")
# strategy -> (shard optimizer+master, shard grads, shard params, offload optimizer+params to host)
_SHARDING = {
    "ddp": (False, False, False, False),
    "zero1": (True, False, False, False),
    "zero2": (True, True, False, False),
    "fsdp_grad_op": (True, True, False, False),
    "zero3": (True, True, True, False),
    "fsdp": (True, True, True, False),
    "zero3_offload": (True, True, True, True),
}
STRATEGIES = tuple(_SHARDING)
#: Strategies whose engine can shard a frozen model (ZeRO-3, FSDP). ``fsdp_grad_op`` is FSDP too: a
#: frozen model has no backward, so its parameters are resharded after forward whatever the policy does.
SHARDS_FROZEN = ("zero3", "fsdp", "fsdp_grad_op", "zero3_offload")
TRANSIENT = ("activations", "optimizer step temp", "compute gradients (bf16)")


def _check(value: Any, allowed: Sequence[Any], what: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{what} must be one of {list(allowed)}, got {value!r}")


# --------------------------------------------------------------------------- inputs
@dataclass
class MemoryInputs:
    """Everything the estimate depends on; validated on construction."""

    policy: ModelDims
    param_dtype: str = "bf16"
    master_weights_fp32: bool = False  # mixed precision keeps an fp32 copy of trainable params
    optimizer: str = "adamw"
    optimizer_state_dtype: str = "fp32"  # torch AdamW on bf16 params without master keeps bf16 states
    optimizer_impl: str = "fused"  # "foreach" adds a state-sized temporary at step time
    lora_r: int | None = None
    lora_targets: Sequence[str] = ("q", "k", "v", "o")
    lora_dtype: str = "fp32"  # peft upcasts bf16/fp16 adapters to fp32 (autocast_adapter_dtype)
    lora_dropout: float = 0.0
    gradient_checkpointing: bool = False
    fused_layers: bool = False  # training.fused_layers (models/fused.py): leaner SwiGLU MLP and RMSNorm saves
    per_device_batch: int = 1
    seq_len: int = 2048
    sequences_per_example: int = 1  # 2 for DPO-style pairs (chosen + rejected in one forward)
    image_tokens: int = 0  # mmdit: image patch tokens of each sequence (the rest of seq_len is text); 0 = all
    chunked_logits: bool = True  # alignkit's ops compute log-probs in chunks: no (B, T, V) tensors
    reference: str = "none"  # "model" holds a copy; "lora_base"/"precomputed" cost nothing
    frozen_models: Sequence[ModelDims] = ()  # reward / cost models, held in param_dtype
    extra_trainable: Sequence[ModelDims] = ()  # further trained models (a critic; LoRA: trained_params), sharded like the policy
    extra_activation_bytes: int = 0  # activations of other trained models whose loss shares the micro-batch (added)
    shard_frozen: bool = False  # shard reference + frozen models under SHARDS_FROZEN strategies
    frozen_params: int = 0  # policy params held but never trained (a VLM's frozen vision tower / LM)
    n_gpus: int = 1
    activation: str = "llama"  # method in ACTIVATION_METHODS
    device: str = "cuda"  # "cuda" | "cpu" (no CUDA overhead; adds process_baseline_bytes)
    overhead_bytes: int | None = None  # None -> CUDA_OVERHEAD_BYTES on cuda, 0 on cpu
    process_baseline_bytes: int = 0  # cpu: RSS of python + torch + transformers before model build
    reserved_fraction: float = 0.0  # share of the device memory held outside the models (colocated vLLM engine)
    #: fp32-held weights computed under autocast in param_dtype (alignkit's single / DDP runs on a GPU): full
    #: fine-tuning keeps an fp32 residual stream and fp32 grads; a LoRA base is held in param_dtype
    autocast: bool = False
    #: bf16 compute weights (model.compute_weights: cast; distributed/strategy/compute_weights.py): a bf16 copy of
    #: the fp32 masters computes (bf16 residual stream), fp32 master gradients, bf16 compute gradients in between
    compute_weights: bool = False
    logits_chunk_rows: int = 1024  # rows per chunk of the chunked LM head (ops.logprobs.chunk_rows)
    #: tokens of the largest micro-batch the run draws (all its sequences), read off its data; None = worst case
    drawn_tokens: int | None = None
    accumulation: int = 1  # gradient_accumulation_steps: >1 keeps gradients alive across micro-batches

    def __post_init__(self) -> None:
        _check(self.param_dtype, list(DTYPE_BYTES), "param_dtype")
        _check(self.optimizer_state_dtype, list(DTYPE_BYTES), "optimizer_state_dtype")
        _check(self.lora_dtype, list(DTYPE_BYTES), "lora_dtype")
        _check(self.optimizer, list(OPTIMIZER_STATES), "optimizer")
        _check(self.optimizer_impl, OPTIMIZER_IMPLS, "optimizer_impl")
        _check(self.reference, REFERENCE_KINDS, "reference")
        _check(self.device, ("cuda", "cpu"), "device")
        _check(self.activation, ACTIVATION_METHODS.names(), "activation")
        self.lora_targets = tuple(self.lora_targets)
        self.frozen_models = tuple(self.frozen_models)
        self.extra_trainable = tuple(self.extra_trainable)
        known = self.policy.lora_target_names
        for t in self.lora_targets:
            if known is not None:
                _check(t, known, "each lora_targets entry")
            elif self.lora_r is not None and not self.policy.lora_params(1, [t]):
                raise ValueError(f"lora_targets entry {t!r} names no linear layer of the model")
        if self.lora_r is not None and (self.lora_r < 1 or not self.lora_targets):
            raise ValueError("lora_r must be >= 1 with at least one lora_targets entry")
        if self.reference == "lora_base" and self.lora_r is None:
            raise ValueError("reference='lora_base' needs LoRA (set lora_r)")
        for name in ("per_device_batch", "seq_len", "sequences_per_example", "n_gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch on one device: the largest drawn one when known, else the worst case."""
        return self.worst_case_tokens if self.drawn_tokens is None else min(self.drawn_tokens, self.worst_case_tokens)

    @property
    def worst_case_tokens(self) -> int:
        """``B * sequences_per_example * T``: every sequence at ``max_length``."""
        return self.per_device_batch * self.sequences_per_example * self.seq_len

    @property
    def p(self) -> int:
        return DTYPE_BYTES[self.param_dtype]


def trainable_params(inputs: MemoryInputs) -> int:
    """All params but the frozen ones for full fine-tuning; for LoRA ``sum r * (in + out)`` over targets
    and layers."""
    if inputs.lora_r is None:
        return inputs.policy.n_params - inputs.frozen_params
    return inputs.policy.lora_params(inputs.lora_r, inputs.lora_targets)


# --------------------------------------------------------------------------- estimate
@dataclass
class MemoryEstimate:
    """Per-GPU bytes by component (``gpu``) and per-rank host bytes (``cpu``, offload only)."""

    strategy: str
    gpu: dict[str, int]
    cpu: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Persistent rows + max of the transient rows (activations vs optimizer-step temporaries)."""
        persistent = sum(v for k, v in self.gpu.items() if k not in TRANSIENT)
        return persistent + max([self.gpu.get(k, 0) for k in TRANSIENT])

    @property
    def cpu_total(self) -> int:
        return sum(self.cpu.values())


def estimate(inputs: MemoryInputs, strategy: str) -> MemoryEstimate:
    """Per-GPU memory of ``inputs`` under ``strategy`` (see the module docstring for the rules)."""
    _check(strategy, STRATEGIES, "strategy")
    if inputs.autocast and strategy != "ddp":  # DeepSpeed and FSDP's mixed precision cast the module itself
        inputs = dataclasses.replace(inputs, autocast=False)
    cast = inputs.compute_weights and strategy == "ddp" and inputs.lora_r is None and inputs.param_dtype != "fp32"
    if cast:  # the bf16 copy computes: no autocast over fp32 weights
        inputs = dataclasses.replace(inputs, autocast=False)
    shard_opt, shard_grads, shard_params, offload = _SHARDING[strategy]
    n, p, d = inputs.n_gpus, inputs.p, inputs.policy
    lora = inputs.lora_r is not None
    n_train = trainable_params(inputs)
    tb = DTYPE_BYTES[inputs.lora_dtype] if lora else p  # trainable params' dtype bytes

    def split(value: float, sharded: bool) -> int:
        return int(math.ceil(value / n)) if sharded else int(value)

    weights = d.n_params * p + (n_train * tb if lora else 0)
    master = n_train * 4 if inputs.master_weights_fp32 and tb != 4 else 0
    # under autocast the trained weights are fp32 leaves: their .grad is fp32 (the compute-dtype copies are
    # the "policy weights" row, held from forward to backward)
    grads = n_train * (4 if offload or inputs.autocast or cast else tb)
    states = n_train * OPTIMIZER_STATES[inputs.optimizer] * DTYPE_BYTES[inputs.optimizer_state_dtype]
    host = {
        "policy weights": split(weights, shard_params),
        "master weights (fp32)": split(master, shard_opt),
        "gradients": split(grads, shard_grads),
        "optimizer states": split(states, shard_opt),
    }
    if inputs.extra_trainable:
        host["other trainable models"] = _extra_trainable_bytes(inputs, split, shard_params, shard_opt, shard_grads)
    gpu: dict[str, int] = {} if offload else dict(host)
    if shard_params:  # gathered params (current + prefetched unit) + one unsharded gradient unit
        unit = max(d.layer_params, d.vocab * d.hidden)
        gpu["zero3 working set"] = 2 * unit * p + int(unit * tb * min(1.0, n_train / d.n_params))
    shard_frozen = inputs.shard_frozen and strategy in SHARDS_FROZEN
    ref = (d.n_params + d.frozen_parts) * p if inputs.reference == "model" else 0
    gpu["reference model"] = split(ref, shard_frozen)
    gpu["frozen models"] = split(sum(m.n_params + m.frozen_parts for m in inputs.frozen_models) * p, shard_frozen)
    # a diffusion pipeline's VAE + text encoders sit beside the trained transformer: no engine shards them
    gpu["frozen pipeline parts"] = sum(m.frozen_parts for m in (d, *inputs.extra_trainable)) * p
    gpu["activations"] = activation_bytes(inputs) + inputs.extra_activation_bytes
    step_temp = 0
    impl = inputs.optimizer_impl if inputs.optimizer_impl != "auto" else ("fused" if strategy == "ddp" else "foreach")
    if not offload and impl == "foreach" and OPTIMIZER_STATES[inputs.optimizer]:
        step_temp = split(n_train * DTYPE_BYTES[inputs.optimizer_state_dtype], shard_opt)
    elif not offload and impl == "for_loop":  # one parameter's temporary at a time
        biggest = inputs.lora_r * max(map(sum, d.linear_shapes().values())) if lora else max(
            d.vocab * d.hidden, d.hidden * d.intermediate)
        step_temp = biggest * DTYPE_BYTES[inputs.optimizer_state_dtype]
    gpu["optimizer step temp"] = step_temp
    _transient_gradients(gpu, inputs, strategy, n_train * p if cast else None)
    overhead = inputs.overhead_bytes
    gpu["overhead"] = (CUDA_OVERHEAD_BYTES if inputs.device == "cuda" else 0) if overhead is None else overhead
    if inputs.device == "cpu":
        gpu["process baseline"] = inputs.process_baseline_bytes
    return MemoryEstimate(strategy, gpu, host if offload else {})


def _transient_gradients(gpu: dict[str, int], inputs: MemoryInputs, strategy: str, compute_grads: int | None) -> None:
    """The rows of gradients that do not persist: ``compute_grads`` (bf16 compute weights: the compute copy's bf16
    gradients, until ``accumulate_grads`` adds them into the fp32 master gradients; None without), and the
    gradients themselves where :func:`grads_transient` (they live from backward to the step)."""
    if compute_grads is not None:
        gpu["compute gradients (bf16)"] = compute_grads
    if grads_transient(inputs, strategy):
        gpu["optimizer step temp"] += gpu["gradients"]
        if compute_grads is not None:  # the fp32 master gradients are created while the bf16 ones still live
            gpu["compute gradients (bf16)"] += gpu["gradients"]
        del gpu["gradients"]


def grads_transient(inputs: MemoryInputs, strategy: str) -> bool:
    """True where no engine holds gradient buffers: one CUDA device without DDP (alignkit's single strategy,
    ``zero_grad(set_to_none=True)``) and no accumulation. The gradients then appear layer by layer as backward
    frees the activations, so the peak is the larger of the start of backward (activations + the LM head's
    backward, :func:`~alignkit.planner.activations.lm_head_backward_bytes`) and the optimizer step (gradients + its temporaries). CPU runs keep the persistent count (their
    RSS calibration)."""
    return strategy == "ddp" and inputs.n_gpus == 1 and inputs.accumulation == 1 and inputs.device == "cuda"


def _extra_trainable_bytes(inputs: MemoryInputs, split: Any, shard_params: bool, shard_opt: bool,
                           shard_grads: bool) -> int:
    """Weights + fp32 master + grads + optimizer states of the further trained models; one with
    ``trained_params`` (LoRA) holds its base in the compute dtype and trains fp32 adapters (no master copy)."""
    p, total = inputs.p, 0
    n_states = OPTIMIZER_STATES[inputs.optimizer] * DTYPE_BYTES[inputs.optimizer_state_dtype]
    for m in inputs.extra_trainable:
        lora = m.trained_params is not None
        t = m.trained_params if lora else m.n_params
        tb = 4 if lora else p
        master = t * 4 if inputs.master_weights_fp32 and tb != 4 else 0
        total += (split(m.n_params * p + (t * tb if lora else 0), shard_params)
                  + split(master + t * n_states, shard_opt) + split(t * tb, shard_grads))
    return total


def fits(estimate: MemoryEstimate, device_memory_bytes: int, headroom: float = 0.9) -> bool:
    """True when the estimate uses at most ``headroom`` of the device memory."""
    return estimate.total <= headroom * device_memory_bytes


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def choose_strategy(inputs: MemoryInputs, device_memory_bytes: int | None,
                    available: Sequence[str] = ("ddp", "zero2", "zero3", "zero3_offload"),
                    headroom: float = 0.9) -> tuple[str, str]:
    """The cheapest-communication strategy in ``available`` that fits, and why.

    Without device memory, fall back to the parameter-count rule users know (<1B ddp, 1-7B zero2,
    larger zero3); published "7B" checkpoints span 6.7-7.6B, so the 7B class ends below 8B.
    """
    order = [s for s in COMM_ORDER if s in available]
    unknown = [s for s in available if s not in STRATEGIES]
    if unknown or not order:
        raise ConfigError(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    if device_memory_bytes is None:
        n = inputs.policy.n_params
        want, cls = (("ddp", "<1B"), ("zero2", "1B-7B class (<8B)"), ("zero3", ">=8B"))[
            (n >= 1e9) + (n >= 8e9)]
        pick = next((s for s in order if COMM_ORDER.index(s) >= COMM_ORDER.index(want)), order[-1])
        return pick, (f"device memory unknown: parameter-count rule, {n / 1e9:.2f}B params is {cls} "
                      f"-> {want}" + ("" if pick == want else f" (not available; using {pick})"))
    headroom -= inputs.reserved_fraction  # a colocated rollout engine's share is not the training state's
    usable = headroom * device_memory_bytes
    misses = []
    for s in order:
        est = estimate(inputs, s)
        if fits(est, device_memory_bytes, headroom):
            why = "; ".join(misses + [f"{s} needs {_gb(est.total)}/GPU <= {_gb(usable)} usable -> {s}"])
            return s, why
        misses.append(f"{s} needs {_gb(est.total)}/GPU > {_gb(usable)} usable")
    best = min(order, key=lambda s: estimate(inputs, s).total)
    return best, ("; ".join(misses) + f" -> nothing fits; {best} is smallest (expect OOM: lower "
                  "per_device_batch or seq_len, enable gradient checkpointing or LoRA, add GPUs)")


def frozen_bytes(est: MemoryEstimate) -> int:
    """Per-GPU bytes of the reference and the other frozen models in ``est``."""
    return est.gpu.get("reference model", 0) + est.gpu.get("frozen models", 0)


def choose_shard_frozen(replicated: MemoryEstimate, sharded: MemoryEstimate, device_memory_bytes: int | None,
                        headroom: float = 0.9) -> tuple[bool, str]:
    """``distributed.shard_frozen: auto``: shard the frozen models, and why.

    ``replicated`` / ``sharded`` are one strategy's estimates with ``shard_frozen`` False / True.
    Sharding costs an all-gather per layer in every frozen forward, so it happens only where the
    engine shards parameters (:data:`SHARDS_FROZEN`), the run does not fit with replicated copies
    (``headroom`` of ``device_memory_bytes``) and the sharded estimate is smaller (not on one rank).
    """
    name, held = replicated.strategy, frozen_bytes(replicated)
    if name not in SHARDS_FROZEN:
        return False, f"{name} does not shard parameters"
    if not held:
        return False, "no frozen model is held"
    if device_memory_bytes is None:
        return False, "device memory unknown"
    usable = f"{headroom:g} x {_gb(device_memory_bytes)}"
    rep = f"{_gb(replicated.total)} per rank with them replicated ({_gb(held)})"
    if fits(replicated, device_memory_bytes, headroom):
        return False, f"{rep} <= {usable}"
    if sharded.total >= replicated.total:
        return False, f"{rep} > {usable}, but sharding them saves nothing here"
    tail = "" if fits(sharded, device_memory_bytes, headroom) else " (still over: expect OOM)"
    return True, f"{rep} > {usable}; {_gb(sharded.total)} sharded{tail}"


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": GB, "gb": GB,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": GIB, "gib": GIB, "ti": 2**40, "tib": 2**40}


def parse_memory(text: str | int) -> int:
    """``"80GB"``/``"80G"`` -> 80e9, ``"64GiB"`` -> 64 * 2**30, ``"512MiB"``; an int passes through."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"cannot parse memory size {text!r}: expected a number and a unit such as "
                         "'80GB', '80G', '64GiB' or '512MiB' (GB/G = 1e9 bytes, GiB/Gi = 2**30)")
    return int(float(m.group(1)) * _UNITS[unit])
