"""Attention for padding-free packed rows: each packed example attends only to itself.

A packed micro-batch is one row (B=1) of S examples. The collator computed the row's boundaries on the
host (``data.collate.packed_boundaries``) and they reach this function through the model's ``**kwargs``:
``cu_seq_lens_q/k`` (int32 ``(S+1,)``, on the device), ``max_length_q/k`` and ``packed_seq_lens`` (Python
ints). Nothing here asks the device where the examples start: on a GPU every such question (a
``nonzero``, a ``.tolist()``) drains the queue and leaves the GPU idle, once per layer.

``sdpa_packed`` (what ``model.attn_implementation: auto`` and ``sdpa`` load) runs a packed row with

* on CUDA in half precision: flash-attention's ``flash_attn_varlen_func`` when ``flash_attn`` is installed,
  else PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` where the installed torch has it;
* otherwise (CPU, fp32, attention dropout): one causal SDPA call per example, split at the host lengths
  (the CPU analogue of a varlen kernel: sum(L_i^2) work, no (T, T) mask).

Everything else (padded batches, generation with a KV cache) goes to transformers' SDPA unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from alignkit.data.collate import CU_SEQ_LENS_K, CU_SEQ_LENS_Q, MAX_LENGTH_K, MAX_LENGTH_Q, PACKED_KEYS, PACKED_SEQ_LENS
from alignkit.errors import ConfigError

NAME = "sdpa_packed"

#: what ``packed_kernel`` may answer, fastest first
FLASH_ATTN, TORCH_VARLEN, PER_EXAMPLE = "flash_attn varlen", "torch varlen_attn", "SDPA per example"
HALF = (torch.float16, torch.bfloat16)


@functools.cache
def flash_varlen() -> Callable[..., torch.Tensor] | None:
    """flash-attention's ``flash_attn_varlen_func``, or None when the package is not installed."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # installed but built for another torch / CUDA
        return None
    return flash_attn_varlen_func


@dataclass(frozen=True)
class VarlenApi:
    """How the installed ``torch.nn.attention.varlen.varlen_attn`` is called: its keywords differ per release.

    * torch 2.9: no module (``torch_varlen`` answers None: packed rows run SDPA per example);
    * torch 2.10: ``varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None)``: no
      ``scale`` (folded into q), no ``window_size``, no GQA (kv heads repeated);
    * torch 2.11+: keyword-only ``scale`` and ``window_size`` (``(-1, 0)`` is causal);
    * torch 2.13: ``enable_gqa`` beside them.

    A sliding window never reaches the kernel: :func:`packed_sdpa` refuses a packed example longer than the
    window, and within it a sliding window is plain causal attention."""

    fn: Callable[..., torch.Tensor]
    causal: str  # the keyword that makes it causal: "window_size" or "is_causal"
    scale: bool  # takes ``scale``
    gqa: bool  # takes ``enable_gqa``

    @classmethod
    def of(cls, fn: Callable[..., torch.Tensor]) -> VarlenApi | None:
        """The API of ``fn`` from its signature; None for a signature that cannot say "causal"."""
        params = inspect.signature(fn).parameters
        causal = next((k for k in ("window_size", "is_causal") if k in params), None)
        if causal is None:
            return None
        return cls(fn, causal, "scale" in params, "enable_gqa" in params)

    @property
    def label(self) -> str:
        """The keywords this release takes, for the start-up line (``is_causal`` only: torch 2.10's API)."""
        return "+".join([self.causal] + ["scale"] * self.scale + ["enable_gqa"] * self.gqa)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scaling: float | None) -> torch.Tensor:
        """Causal attention within each ``[cu[i], cu[i+1])`` span; q (T, H, D), k/v (T, H_kv, D) -> (T, H, D)."""
        extra: dict[str, Any] = {"window_size": (-1, 0)} if self.causal == "window_size" else {"is_causal": True}
        if scaling is not None and self.scale:
            extra["scale"] = scaling
        elif scaling is not None and scaling != q.shape[-1] ** -0.5:  # the kernel's own scale is 1/sqrt(D)
            q = q * (scaling * q.shape[-1] ** 0.5)
        gqa = q.shape[1] != k.shape[1]
        if gqa and not self.gqa:  # kv head j serves query heads j*r .. j*r+r-1, as enable_gqa does
            r = q.shape[1] // k.shape[1]
            k, v = (x[:, :, None].expand(-1, -1, r, -1).reshape(x.shape[0], -1, x.shape[-1]) for x in (k, v))
        elif self.gqa:
            extra["enable_gqa"] = gqa
        return self.fn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)


@functools.cache
def torch_varlen() -> VarlenApi | None:
    """The installed ``torch.nn.attention.varlen.varlen_attn`` and how to call it (:class:`VarlenApi`, read from
    its signature once), or None where torch has none (before 2.10) or one whose signature is not known."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return VarlenApi.of(varlen_attn)


@functools.cache
def _flash_capable(index: int) -> bool:
    """Ampere or newer: what both varlen kernels need."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def packed_kernel(device: torch.device, dtype: torch.dtype = torch.bfloat16, dropout: float = 0.0,
                  head_dim: int = 64) -> str:
    """The kernel a packed row runs on ``device`` with q/k/v in ``dtype``: FLASH_ATTN, TORCH_VARLEN or PER_EXAMPLE."""
    if device.type != "cuda" or dtype not in HALF or head_dim % 8 or head_dim > 256:
        return PER_EXAMPLE
    if not _flash_capable(device.index if device.index is not None else torch.cuda.current_device()):
        return PER_EXAMPLE
    if flash_varlen() is not None:
        return FLASH_ATTN
    if torch_varlen() is not None and dropout == 0.0:
        return TORCH_VARLEN
    return PER_EXAMPLE


PACKED_ROW = "packed_row"


class PackedRow:
    """A packed row's boundaries (:data:`PACKED_KEYS`: ``inputs``) as ONE opaque model input that torch.compile
    passes through without reading (no guard on the number of examples or their lengths)."""

    def __init__(self, inputs: dict[str, Any]) -> None:
        self.inputs = inputs


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D), key/value (1, H_kv, T, D) -> output (1, T, H, D), like transformers' SDPA.

    A packed row (``packed_seq_lens`` given) ignores ``attention_mask`` (:func:`packed_model_inputs`' empty
    mask, or transformers' block mask): its boundaries are the lengths."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    row = kwargs.pop(PACKED_ROW, None)
    if row is not None:
        return _packed(query, key, value, dropout if module.training else 0.0, scaling, row), None
    if kwargs.get(PACKED_SEQ_LENS) is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return _packed(query, key, value, dropout if module.training else 0.0, scaling, PackedRow(kwargs)), None


@torch.compiler.disable
def _packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, p: float, scaling: float | None,
            row: PackedRow) -> torch.Tensor:
    """A packed row's attention, outside torch.compile (``training.torch_compile`` compiles the blocks around it):
    its boundaries (``packed_seq_lens``, the number of examples, the longest) change from batch to batch, and a
    compiled region that read them would recompile for each new count; the kernels here are whole ops already."""
    kwargs = row.inputs
    lengths = kwargs[PACKED_SEQ_LENS]
    if sum(lengths) != query.shape[2]:
        raise ValueError(f"packed row of {query.shape[2]} tokens but {PACKED_SEQ_LENS} sums to {sum(lengths)}")
    window = kwargs.get("sliding_window")
    if window is not None and max(lengths) > window:
        raise ValueError(f"a packed example of {max(lengths)} tokens is longer than the model's sliding window "
                         f"({window}), which packed attention does not apply: set data.packing: false or "
                         "model.attn_implementation: eager")
    q, k, v = _half(query, key, value)
    kernel = packed_kernel(query.device, q.dtype, p, query.shape[-1])
    if kernel == PER_EXAMPLE:
        return _per_example(query, key, value, list(lengths), p, scaling)
    return _varlen(kernel, q, k, v, kwargs, p, scaling).unsqueeze(0)


def _half(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in the autocast dtype where autocast is on: a custom kernel is not autocast-aware, and RoPE's
    float32 cos/sin leave q and k in float32 under bf16 autocast while v is bf16 (SDPA would cast them)."""
    kind = query.device.type
    if not torch.is_autocast_enabled(kind):
        return query, key, value
    dtype = torch.get_autocast_dtype(kind)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _per_example(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], p: float,
                 scaling: float | None) -> torch.Tensor:
    """One causal SDPA call per example, split at the host ``lengths``; (1, H, T, D) -> (1, T, H, D)."""
    gqa = query.shape[1] != key.shape[1]
    # split, not slices: a slice's backward writes its gradient into a zeroed full-size tensor (one per
    # example, summed), split's backward is one cat of the pieces
    outs = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2))
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _varlen(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any],
            p: float, scaling: float | None) -> torch.Tensor:
    """A varlen kernel over the whole row: (1, H, T, D) in -> (T, H, D) out, causal within each example."""
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (T, H, D): the kernels' layout
    # (already that layout in memory: transformers' q/k/v are (1, T, H, D) views transposed)
    # no-ops when the batch was moved with its tensors (Batch.to); the lengths are the collator's
    cu_q = kwargs[CU_SEQ_LENS_Q].to(q.device, torch.int32, non_blocking=True)
    cu_k = kwargs[CU_SEQ_LENS_K].to(q.device, torch.int32, non_blocking=True)
    max_q, max_k = int(kwargs[MAX_LENGTH_Q]), int(kwargs[MAX_LENGTH_K])
    if kernel == FLASH_ATTN:
        fn = flash_varlen()
        assert fn is not None
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=p, softmax_scale=scaling, causal=True)
    api = torch_varlen()
    assert api is not None
    return api(q, k, v, cu_q, cu_k, max_q, max_k, scaling)


def packed_model_inputs(model: torch.nn.Module, inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``inputs`` of a packed row for a model whose language model runs ``sdpa_packed``, with ``attention_mask``
    an empty ``(1, 1, T, 0)`` "prepared mask": transformers returns a 4D mask as it is, so it skips its mask
    creation, which for a packed row reads the device once per forward (``find_packed_sequence_indices``) and
    builds a (T, T) mask that the kernels here never read. Any other attention would fail on the empty mask
    loudly, so other models (and padded batches) get their inputs back unchanged.

    The row's boundaries (:data:`PACKED_KEYS`) travel as ONE opaque :class:`PackedRow` (``packed_row``) that only
    the kernels here open: a compiled decoder block (``training.torch_compile``) never reads them, so a new
    number of examples or a new longest one does not recompile it."""
    lengths = inputs.get(PACKED_SEQ_LENS)
    if lengths is None or inputs.get("attention_mask") is not None or not uses_packed_attention(model):
        return inputs
    plain = {k: v for k, v in inputs.items() if k not in PACKED_KEYS}
    return {**plain, PACKED_ROW: PackedRow({k: inputs[k] for k in PACKED_KEYS if k in inputs}),
            "attention_mask": torch.empty((1, 1, sum(lengths), 0), dtype=torch.bool, device=device)}


def uses_packed_attention(model: torch.nn.Module) -> bool:
    """Whether ``model`` (its text config for a VLM) attends with ``sdpa_packed``."""
    config = getattr(model, "config", None)
    return any(getattr(c, "_attn_implementation", None) == NAME for c in (config, getattr(config, "text_config", None)))


def sdpa_mask_without_sync(*args: Any, **kwargs: Any) -> Any:
    """transformers' ``sdpa_mask``, minus its read-back: with a padding mask it asks the device whether the
    mask is all ones (``_ignore_causal_mask_sdpa``: two host syncs per forward) to skip it. A padded batch
    almost always has padding, so a given mask is built as it is (no question asked; a batch without padding
    pays a mask it could have skipped), and a missing one still takes SDPA's ``is_causal`` path."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is not None:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register ``sdpa_packed`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, packed_sdpa)
        # padded batches and generation still need SDPA's masks
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask_without_sync)
    return NAME


#: ``model.attn_implementation`` values that alignkit maps onto ``sdpa_packed``
PACKED_CHOICES = ("auto", "sdpa")


def resolve(requested: str | None) -> str | None:
    """The implementation name to load: ``auto`` and ``sdpa`` become ``sdpa_packed`` (registered here), the
    fastest on every device since its packed-row kernel is picked per call (:func:`packed_kernel`); any other
    name is transformers' own, checked by :func:`check_installed`."""
    if requested in PACKED_CHOICES:
        return register()
    check_installed(requested)
    return requested


def check_installed(requested: str | None, device: torch.device | None = None) -> None:
    """A one-line :class:`ConfigError` where ``flash_attention_2`` cannot run: ``flash_attn`` not installed,
    or (``device`` given) not a CUDA device."""
    if requested != "flash_attention_2":
        return
    if device is not None and device.type != "cuda":
        raise ConfigError(f"model.attn_implementation: flash_attention_2 needs a CUDA GPU (this run's device is "
                          f"{device.type}); choose auto (packed rows attend per example on {device.type})")
    if flash_varlen() is None:
        raise ConfigError("model.attn_implementation: flash_attention_2 needs the flash_attn package, which is not "
                          "installed (or does not import): pip install flash-attn --no-build-isolation, or choose "
                          "auto (packed rows then use torch's varlen_attn where it exists)")


def describe(requested: str | None, device: torch.device) -> str:
    """The start-up line: what ``model.attn_implementation`` loads and which kernel a packed row runs on ``device``."""
    if requested not in PACKED_CHOICES:
        return f"Attention: {requested or 'the model default'} (transformers' own; model.attn_implementation)"
    packed = packed_kernel(device)
    api = torch_varlen() if packed == TORCH_VARLEN else None
    packed += f" ({api.label})" if api is not None else ""
    half = "" if packed == PER_EXAMPLE or device.type != "cuda" else " in bf16/fp16 (fp32: SDPA per example)"
    return (f"Attention: {NAME} (model.attn_implementation={requested}): padded batches PyTorch SDPA, packed rows "
            f"{packed}{half} on {device.type}")
