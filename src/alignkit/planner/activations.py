"""Activation memory of one training micro-batch (the estimator's ``activations`` row).

Split from :mod:`alignkit.planner.plan`: per-token bytes a decoder layer saves for backward,
by method (``llama``: read off the HF layer; ``korthikanti``: the published rule), and the peak
breakdown at the start of backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from alignkit.registry import Registry

if TYPE_CHECKING:
    from alignkit.planner.plan import MemoryInputs

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

ACTIVATION_METHODS: Registry[Callable[[MemoryInputs], int]] = Registry("activation method")


def layer_saved_bytes_per_token(inputs: MemoryInputs) -> int:
    """Bytes one HF Llama decoder layer saves for backward, per token (SDPA/flash: no T^2 term).

    Read off ``LlamaDecoderLayer`` (and checked against ``saved_tensors_hooks`` in the tests);
    ``p`` = bytes(param_dtype), ``H`` hidden, ``Q = n_heads*head_dim``, ``K = n_kv_heads*head_dim``:

    * each RMSNorm: the fp32 upcast input ``4H`` (``pow``/``mul``), the normalised tensor ``pH`` (for
      the weight's grad, only if norms train) and its output ``pH`` (input of the next linears, saved
      only if one of them trains; LoRA saves its own cast/dropout copy instead, see below);
    * attention: rotated q ``pQ``, k and v ``2pK`` (SDPA uses ``enable_gqa``, no repeat), the SDPA
      output ``pQ`` (= o_proj input, same storage), logsumexp ``4*n_heads``;
    * MLP: gate output ``pI`` (SiLU input), SiLU output and up output ``2pI`` (the product), the
      product ``pI`` (down_proj input, only if down trains);
    * LoRA per target: ``r*bytes(lora)`` (lora_A output); plus, when the adapter dtype differs from
      ``param_dtype``, the cast input ``in*bytes(lora)``; with dropout instead, its output + mask
      (bool on CUDA, x's dtype on CPU).
    Full fine-tuning, fp32: ``24H + 8H + 8K + 16I`` = ``(10H + 4I)*4`` for MHA.

    With ``fused_layers`` (alignkit's :mod:`alignkit.models.fused`): each RMSNorm keeps its input in its own
    dtype ``pH`` (no upcast copy, no normalised tensor); an MLP none of whose projections LoRA targets keeps
    gate and up outputs ``2pI`` and its input ``pH`` only when its weights train (SiLU output and product
    are recomputed in the backward).
    """
    d, p = inputs.policy, inputs.p
    h, i, q, kv = d.hidden, d.intermediate, d.n_heads * d.hd, d.n_kv_heads * d.hd
    full = inputs.lora_r is None
    if inputs.autocast and full:
        return _autocast_full_layer_bytes(inputs)
    targets = set() if full else set(inputs.lora_targets)
    # the input (fp32 upcast; fused: its own dtype) + the normalised tensor when norms train (fused: recomputed)
    norm = _norm_input_bytes(inputs) * h + (p * h if full and not inputs.fused_layers else 0)
    attn = p * (2 * q + 2 * kv) + 4 * d.n_heads  # rotated q, k, v, SDPA output, logsumexp
    rsqrt = 2 * 4
    if inputs.fused_layers and not targets & {"gate", "up", "down"}:
        mlp = 2 * p * i + (p * h if full else 0)  # gate and up outputs (+ the input, for the weights' grads)
    else:
        # gate, SiLU, up outputs
        mlp = 3 * p * i + _linear_input_bytes(inputs, ("gate", "up"), h) + _linear_input_bytes(inputs, ("down",), i)
    return (2 * norm + rsqrt + _linear_input_bytes(inputs, ("q", "k", "v"), h) + attn
            + _linear_input_bytes(inputs, ("o",), q, already_saved=True) + mlp)


def _linear_input_bytes(inputs: MemoryInputs, mods: Sequence[str], in_features: int,
                        already_saved: bool = False) -> int:
    """Per token: bytes kept for the input shared by the linears ``mods`` (q, k and v read the same norm
    output), full fine-tuning or LoRA (lora_A's output, a cast or dropout copy of the input)."""
    p, full = inputs.p, inputs.lora_r is None
    if full:
        return 0 if already_saved else p * in_features
    hits = sum(m in set(inputs.lora_targets) for m in mods)
    if not hits:
        return 0  # frozen linears need only their weight for the input gradient
    lb = DTYPE_BYTES[inputs.lora_dtype]
    drop = inputs.lora_dropout > 0
    # CUDA's fused dropout keeps a bool mask; the CPU path multiplies by a noise tensor of x's dtype.
    mask = 1 if inputs.device == "cuda" else lb
    if inputs.autocast:  # peft's fp32 cast of x is transient: lora_A's autocast copy (p bytes) is what it saves
        return hits * (inputs.lora_r * p + p * in_features + (mask * in_features if drop else 0))
    cast = inputs.lora_dtype != inputs.param_dtype
    per_hit = inputs.lora_r * lb  # lora_A output, saved by lora_B
    if drop:
        per_hit += (lb + mask) * in_features  # dropout output + its mask
    elif cast:
        per_hit += lb * in_features  # x.to(lora dtype), saved by lora_A
    shared = 0 if (cast or drop or already_saved) else p * in_features
    return shared + hits * per_hit


def _autocast_full_layer_bytes(inputs: MemoryInputs) -> int:
    """Per token: a decoder layer of fp32 weights trained under autocast (alignkit's single / DDP GPU runs).

    The residual stream stays fp32 (fp32 embedding + bf16 linear outputs promote to fp32), so each unfused
    RMSNorm keeps its fp32 input ``4H``, its fp32 normalised tensor ``4H`` (the weight's grad) and ``rsqrt``;
    every projection casts its input to the autocast dtype ``p`` itself (autocast caches casts of weights,
    not of activations): ``3pH`` for q, k, v and ``2pH`` for gate, up. Attention: RoPE promotes q, k to fp32
    (cos/sin follow the fp32 hidden states), SDPA casts them back (``pQ``, ``pK``), v ``pK``, its output
    ``pQ`` (o_proj's input, the same storage) and logsumexp ``4 n_heads``. MLP: gate, SiLU, up outputs and
    their product ``4pI``. (The per-example SDPA of packed rows that the H100 runs used concatenated the outputs,
    one more ``pQ`` copy: ~2.6% of a layer at the Qwen2.5-0.5B shape, not counted; varlen kernels do not copy.)
    Fused layers (models/fused.py): each norm keeps only its fp32 input; the MLP keeps gate, up and its input.
    """
    d, p = inputs.policy, inputs.p
    h, i, q, kv = d.hidden, d.intermediate, d.n_heads * d.hd, d.n_kv_heads * d.hd
    norms = 2 * (4 * h + (0 if inputs.fused_layers else 4 * h) + 4)
    attn = 3 * p * h + p * (2 * q + 2 * kv) + 4 * d.n_heads
    mlp = 2 * p * i + p * h if inputs.fused_layers else 2 * p * h + 4 * p * i
    return norms + attn + mlp


def lm_head_backward_bytes(inputs: MemoryInputs, tokens: int) -> int:
    """The chunked LM head's backward transients at the start of backward (ops/logprobs.py): one chunk's
    fp32 logits, ``logits - lse`` and its ``exp`` (``3 x 4 x rows x V``), the input's gradient ``pH`` per token,
    and the head weight's gradient ``pVH`` when the head trains (full fine-tuning: tied or not, it is built in
    the compute dtype, then cast to the fp32 ``.grad``)."""
    d, p = inputs.policy, inputs.p
    if not inputs.chunked_logits or d.head != "lm":
        return 0
    rows = min(inputs.logits_chunk_rows, tokens)
    head_grad = p * d.vocab * d.hidden if inputs.lora_r is None else 0
    return 3 * 4 * rows * d.vocab + p * d.hidden * tokens + head_grad


def activation_breakdown(inputs: MemoryInputs) -> dict[str, int]:
    """Peak activation bytes on one device, by part; the peak is at the start of backward.

    * ``layers``: without GC, ``n_layers * layer_saved_bytes_per_token * tokens``; with GC, each
      layer's checkpointed input ``pH`` plus one recomputed layer's saved set. LoRA without GC: the
      first layer's input (frozen embedding output) needs no grad, so its norm/dropout keep nothing.
    * ``final_norm``: the last RMSNorm (``4H`` + normed/output when the norm / lm head train).
    * ``logits`` (``chunked_logits=False``, the plain HF loss): the logits ``pV`` held in the model
      output + the fp32 log-softmax saved by cross-entropy ``4V``; ``logits_backward``: at the start
      of backward nll/log-softmax backward add fp32 grads of log-probs and of logits, ``8V``.
      Chunked log-probs (alignkit's ops): 0 for both.
    Not counted: per-layer gradient temporaries during backward (a few ``pH``/``pI`` per token, smaller
    than the logits transients that dominate the start of backward), position ids, RoPE cos/sin.
    """
    d, p, n = inputs.policy, inputs.p, inputs.tokens
    per_layer = ACTIVATION_METHODS.get(inputs.activation)(inputs)
    full = inputs.lora_r is None
    if inputs.gradient_checkpointing:
        # each layer's checkpointed input (fp32 under autocast over fp32 weights: the residual stream)
        res = 4 if inputs.autocast and full else p
        layers = d.n_layers * res * d.hidden * n + per_layer * n
    else:
        layers = d.n_layers * per_layer * n
        if not full and inputs.activation == "llama":
            layers -= _first_layer_no_grad_bytes(inputs) * n
    # its input, + its output (the LM head's input) and, unfused, the normalised tensor when the norm / head train
    trained = (1 if inputs.fused_layers else 2) * p * d.hidden if full else 0
    if inputs.autocast:  # fp32 input (+ fp32 normalised tensor when it trains); the chunked head keeps its p-cast input
        trained = (0 if inputs.fused_layers or not full else 4 * d.hidden) + p * d.hidden
    final_norm = (_norm_input_bytes(inputs) * d.hidden + trained + 4) * n
    if d.head == "mmdit":
        layers, final_norm = _mmdit_ends(inputs, layers)
    v = 0 if inputs.chunked_logits or d.head != "lm" else d.vocab
    head = lm_head_backward_bytes(inputs, n)
    if inputs.gradient_checkpointing:
        # the recomputed layer's set exists only in its own backward, after the head's transients are freed
        head = max(0, head - per_layer * n)
    return {"layers": layers, "final_norm": final_norm, "logits": (p + 4) * v * n,
            "logits_backward": 8 * v * n + head}


def _mmdit_ends(inputs: MemoryInputs, layers: int) -> tuple[int, int]:
    """MMDiT's two ends: the last block's text stream stops after attention (SD3's ``context_pre_only``: it keeps
    ``7 pH`` of the block's 21 per text token, ``6`` fewer under LoRA) and ``norm_out`` + ``proj_out`` read the image
    tokens only (the norm's input, + its normed and modulated outputs when they train: ``3 pH`` / ``1 pH``)."""
    full, ph = inputs.lora_r is None, inputs.p * inputs.policy.hidden
    per_seq = inputs.per_device_batch * inputs.sequences_per_example
    image = per_seq * (inputs.image_tokens or inputs.seq_len)
    if not inputs.gradient_checkpointing:
        layers -= (14 if full else 6) * ph * (inputs.tokens - image)
        dual = MMDIT_DUAL_SAVED + (MMDIT_DUAL_QK_NORM_SAVED if getattr(inputs.policy, "qk_norm", False) else 0)
        layers += dual * ph * image * getattr(inputs.policy, "dual_layers", 0)
    return layers, (3 if full else 1) * ph * image


def _first_layer_no_grad_bytes(inputs: MemoryInputs) -> int:
    """Per token: what layer 0 does not save under LoRA (its input needs no grad): the fp32 norm
    input and, with lora dropout, the noise of q/k/v's dropout (CPU) -- ``mul`` keeps it only for x's grad."""
    hits = sum(t in inputs.lora_targets for t in ("q", "k", "v"))
    noise = DTYPE_BYTES[inputs.lora_dtype] if inputs.lora_dropout > 0 and inputs.device == "cpu" else 0
    return (_norm_input_bytes(inputs) + hits * noise) * inputs.policy.hidden


def _norm_input_bytes(inputs: MemoryInputs) -> int:
    """Bytes per element an RMSNorm keeps of its input: the fp32 upcast (transformers), or the input in its own
    dtype (``fused_layers``; fp32 under autocast over fp32 weights, whose residual stream is fp32)."""
    if inputs.fused_layers and not (inputs.autocast and inputs.lora_r is None):
        return inputs.p
    return 4


@ACTIVATION_METHODS.register("llama")
def _llama_method(inputs: MemoryInputs) -> int:
    return layer_saved_bytes_per_token(inputs)


@ACTIVATION_METHODS.register("korthikanti")
def _korthikanti_method(inputs: MemoryInputs) -> int:
    """Coarse published rule (Korthikanti et al. 2022, eq. 1 without the ``5as/h`` score term, i.e.
    flash attention): ``34 * H`` bytes per token per layer at 2-byte activations, scaled by ``p/2``."""
    return 34 * inputs.policy.hidden * inputs.p // 2


#: MMDiT joint block, tensors saved for backward per token in units of ``p * H`` (read off diffusers'
#: ``JointTransformerBlock`` with SDPA, for both streams): norm1 input, normed, modulated (3); q, k, v (3); SDPA
#: output and its head-merge copy, the to_out input (2); the attention output under the gate (1); norm2 input, normed,
#: modulated (3); FF GELU input and output (4 + 4); the FF output under the gate (1).
MMDIT_FULL_SAVED = 21
#: with LoRA on the attention projections (everything else frozen): norm1 input (1), q, k, v (3), SDPA output (1),
#: norm2 input (1), GELU input (4); the q/k/v input and the to_out input are kept by the adapters (2 more, below)
MMDIT_LORA_SAVED = 10
#: SD3.5's additions, measured (CPU, fp32, full training, the tiny transformers): RMSNorm on q and k adds ~4 pH per
#: token per block; a second, image-only attention (``dual_attention_layers``) ~6 pH per image token, ~5 more with
#: its own q/k norms. Counted the same under LoRA (not measured there).
MMDIT_QK_NORM_SAVED = 4
MMDIT_DUAL_SAVED = 6
MMDIT_DUAL_QK_NORM_SAVED = 5


@ACTIVATION_METHODS.register("mmdit")
def _mmdit_method(inputs: MemoryInputs) -> int:
    """Bytes one MMDiT joint block (SD3) saves for backward per token, image and text tokens alike.

    Full training: ``21 pH``. LoRA (dropout 0) on the attention projections: ``10 pH`` + the two inputs the
    adapters keep (the modulated norm output read by q/k/v, the merged heads read by to_out: ``p H`` each, or
    ``bytes(lora) H`` when peft casts them to the adapters' dtype; with dropout, its output + mask too) + the
    ``lora_A`` outputs ``r`` of the four projections a token passes (``to_q/k/v/out`` or their ``add_*`` twins).
    The ends (the last block's shorter text stream, ``norm_out`` on image tokens): :func:`_mmdit_ends`. Measured on
    CPU in fp32 (bytes of the storages ``saved_tensors_hooks`` sees in one forward of the tiny SD3 transformers,
    1-4 blocks, 96-365 tokens per sequence, tests/unit/distributed/test_pipeline_dims.py): measured / predicted
    1.01-1.05 full, 0.96-0.99 LoRA r=4, 1.01-1.07 with gradient checkpointing (forward's share), 1.00-1.02
    SD3.5-shaped (q/k RMSNorm, a dual-attention block). Not measured: bf16 with fp32
    adapters (the cast inputs follow peft's code) and CUDA's attention kernels (flash / efficient SDPA keep the same
    q, k, v, output and logsumexp as the CPU flash kernel).
    """
    p, h = inputs.p, inputs.policy.hidden
    qk = MMDIT_QK_NORM_SAVED * p * h if getattr(inputs.policy, "qk_norm", False) else 0
    if inputs.lora_r is None:
        return MMDIT_FULL_SAVED * p * h + qk
    lb = DTYPE_BYTES[inputs.lora_dtype]
    kept = lb if inputs.lora_dtype != inputs.param_dtype else p
    if inputs.lora_dropout > 0:
        kept += lb + (1 if inputs.device == "cuda" else lb)  # dropout output + its mask
    hits = min(4, len(inputs.lora_targets))
    return MMDIT_LORA_SAVED * p * h + 2 * kept * h + hits * inputs.lora_r * lb + qk


def activation_bytes(inputs: MemoryInputs) -> int:
    """Sum of :func:`activation_breakdown`."""
    return sum(activation_breakdown(inputs).values())
