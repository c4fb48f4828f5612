"""Per-GPU memory of a generator process of ``rollout.placement: separate`` (``alignkit estimate``'s second table).

A generator trains nothing: no gradients, no optimizer states, no master weights beyond what it receives. What it
holds (``train/generator_loop.py``):

* **policy weights**: the policy's architecture in the trainers' policy dtype (the broadcast copies the weights as
  they are: fp32 master weights for a full fine-tune, the compute dtype for a LoRA policy's base and fp32
  adapters); the ``hf`` engine generates from this module under autocast;
* **vLLM engine** (``rollout.engine: vllm``): the engine's own share of the device,
  ``vllm.gpu_memory_utilization`` x device memory (its bf16 weights and its KV cache inside it);
* **KV cache** (``hf``): ``2 x layers x kv_heads x head_dim`` values in the compute dtype per token, for
  ``min(rollout.generation_batch_size, completions per generator)`` sequences of ``data.max_length +
  rollout.max_new_tokens`` tokens;
* **generation activations**: the larger of the prefill's working set (one decoder layer's hidden, attention and
  MLP tensors of the whole batch of prompts; :data:`LAYER_WIDTHS`) plus the last position's float32 logits and
  probabilities, and the behaviour log-prob forward of the ``hf`` engine (``per_device`` sequences, no grad, the
  chunked LM head's ``(chunk, vocab)`` float32 rows);
* **reward models**: the frozen roles that score on the generators (``reward.model``), in the compute dtype;
* **overhead**: the CUDA context and allocator, as the trainers' estimate counts it.

Total = the persistent rows + the activations. An upper-bound sketch, like the trainers' estimate: nothing is
measured on a GPU here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from alignkit.planner.model_dims import ModelDims
from alignkit.planner.plan import CUDA_OVERHEAD_BYTES, DTYPE_BYTES

#: one decoder layer's live tensors per token, in units of the hidden size (residual, normed input, attention
#: output, q / k / v) and of the MLP width (gate, up, their product) during a no-grad forward
LAYER_WIDTHS = (6, 3)


@dataclass(frozen=True)
class GeneratorInputs:
    """What sizes one generator process (module docstring)."""

    policy: ModelDims
    policy_dtype: str  # as the trainers hold the policy: "fp32" for a full fine-tune's master weights
    compute_dtype: str  # the KV cache, activations and reward models
    engine: str  # "hf" | "vllm"
    batch: int  # sequences per generate call
    seq_len: int  # prompt + completion tokens
    per_device: int  # sequences per behaviour log-prob forward (hf)
    logits_chunk_rows: int = 1024
    frozen_models: Sequence[ModelDims] = ()  # reward / cost models scored on the generators
    engine_fraction: float = 0.0  # vllm.gpu_memory_utilization
    device: str = "cuda"


def generator_estimate(inp: GeneratorInputs, device_memory_bytes: int | None = None) -> dict[str, int]:
    """Bytes per row (module docstring) and ``total``; the vLLM engine's row needs ``device_memory_bytes`` (without
    it the row is 0 and the caller says so)."""
    d, c = inp.policy, DTYPE_BYTES[inp.compute_dtype]
    rows = {"policy weights": d.n_params * DTYPE_BYTES[inp.policy_dtype]}
    if inp.engine == "vllm":
        rows["vLLM engine"] = int(inp.engine_fraction * device_memory_bytes) if device_memory_bytes else 0
    else:
        rows["KV cache"] = 2 * d.n_layers * d.n_kv_heads * d.hd * c * inp.batch * inp.seq_len
    layer = (LAYER_WIDTHS[0] * d.hidden + LAYER_WIDTHS[1] * d.intermediate) * c
    generate = layer * inp.batch * inp.seq_len + 2 * 4 * inp.batch * d.vocab
    behaviour = 0
    if inp.engine != "vllm":
        behaviour = layer * inp.per_device * inp.seq_len + 3 * 4 * min(inp.logits_chunk_rows,
                                                                       inp.per_device * inp.seq_len) * d.vocab
    rows["generation activations"] = max(generate, behaviour)
    rows["reward models"] = sum(m.n_params for m in inp.frozen_models) * c
    rows["overhead"] = CUDA_OVERHEAD_BYTES if inp.device == "cuda" else 0
    rows["total"] = sum(rows.values())
    return rows
