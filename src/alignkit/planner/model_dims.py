"""Architecture numbers of a decoder LM (what the memory estimator needs), from a preset name, a
``transformers`` config or a local model directory. Pure arithmetic; ``transformers`` is imported only
to read a config from disk."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Sequence

from alignkit.errors import ModelError


@dataclass(frozen=True)
class ModelDims:
    """Architecture numbers of a Llama/Mistral/Qwen2-style decoder (``n_params`` = total stored)."""

    n_params: int
    n_layers: int
    hidden: int
    intermediate: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    tied_embeddings: bool
    head_dim: int | None = None  # None -> hidden // n_heads
    head: str = "lm"  # "lm" (causal LM) | "score" (reward/cost model: linear head, no lm_head) | "mmdit"
    #: parameters held frozen beside the model, outside the module that trains (a diffusion pipeline's VAE and
    #: text encoders): in the compute dtype on every rank, never sharded
    frozen_parts: int = 0
    #: trained parameters when not all are (the LoRA adapters of a further trainable model); None = all
    trained_params: int | None = None
    #: the LoRA target names :meth:`lora_params` knows (the estimator's projection names)
    lora_target_names: ClassVar[tuple[str, ...] | None] = ("q", "k", "v", "o", "gate", "up", "down")

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.n_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each projection of one decoder layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.n_heads * self.hd, self.n_kv_heads * self.hd
        return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h),
                "gate": (h, i), "up": (h, i), "down": (i, h)}

    def lora_params(self, r: int, targets: Sequence[str]) -> int:
        """LoRA adapter parameters of rank ``r`` on ``targets``: ``sum r * (in + out)`` over targets and layers."""
        shapes = self.linear_shapes()
        return sum(r * sum(shapes[t]) for t in targets) * self.n_layers

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (projections + 2 norms; biases ignored)."""
        return sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden

    @classmethod
    def llama_like(cls, *, hidden: int, n_layers: int, n_heads: int, intermediate: int, vocab: int,
                   n_kv_heads: int | None = None, tied_embeddings: bool = False,
                   head_dim: int | None = None, qkv_bias: bool = False, o_bias: bool = False,
                   mlp_bias: bool = False, qk_norm: bool = False) -> "ModelDims":
        """Count parameters exactly as HF ``LlamaForCausalLM`` (and Mistral/Qwen2/Qwen3) lay them out."""
        kvh = n_kv_heads or n_heads
        hd = head_dim or hidden // n_heads
        q, kv = n_heads * hd, kvh * hd
        attn = hidden * q + 2 * hidden * kv + q * hidden + (q + 2 * kv if qkv_bias else 0)
        attn += hidden if o_bias else 0
        mlp = 3 * hidden * intermediate + ((2 * intermediate + hidden) if mlp_bias else 0)
        layer = attn + mlp + 2 * hidden + (2 * hd if qk_norm else 0)
        total = vocab * hidden + n_layers * layer + hidden + (0 if tied_embeddings else vocab * hidden)
        return cls(total, n_layers, hidden, intermediate, vocab, n_heads, kvh, tied_embeddings,
                   head_dim=head_dim if head_dim and head_dim != hidden // n_heads else None)

    def as_score_model(self, num_labels: int = 1) -> "ModelDims":
        """The same backbone with a ``hidden -> num_labels`` score head instead of the LM head."""
        lm_head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return replace(self, n_params=self.n_params - lm_head + self.hidden * num_labels,
                       tied_embeddings=False, head="score")


#: Public config numbers; n_params are the well-known totals (6.74B, 7.24B, 494M).
PRESETS: dict[str, ModelDims] = {
    "llama-7b": ModelDims.llama_like(hidden=4096, n_layers=32, n_heads=32, intermediate=11008,
                                     vocab=32000),
    "mistral-7b": ModelDims.llama_like(hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                       intermediate=14336, vocab=32000),
    "qwen2-0.5b": ModelDims.llama_like(hidden=896, n_layers=24, n_heads=14, n_kv_heads=2,
                                       intermediate=4864, vocab=151936, tied_embeddings=True,
                                       qkv_bias=True),
}


def dims_from_hf_config(cfg: Any) -> ModelDims:
    """ModelDims from a ``transformers`` config (Llama/Mistral/Qwen2/Qwen3-style; a VLM's text part).

    A VLM's vision tower is not counted: add its parameters to ``n_params`` with ``dataclasses.replace``.
    """
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None):
        raise ModelError(f"mixture-of-experts config ({text.model_type}) is not supported by the "
                         "estimator; build ModelDims by hand with the total n_params")
    mtype = getattr(text, "model_type", "")
    attention_bias = bool(getattr(text, "attention_bias", False))
    n_heads = text.num_attention_heads
    return ModelDims.llama_like(
        hidden=text.hidden_size, n_layers=text.num_hidden_layers, n_heads=n_heads,
        n_kv_heads=getattr(text, "num_key_value_heads", None) or n_heads,
        intermediate=text.intermediate_size, vocab=text.vocab_size,
        tied_embeddings=bool(getattr(text, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False))),
        head_dim=getattr(text, "head_dim", None),
        qkv_bias=attention_bias or mtype.startswith("qwen2"), o_bias=attention_bias,
        mlp_bias=bool(getattr(text, "mlp_bias", False)), qk_norm=mtype.startswith("qwen3"))


def dims_from_pretrained(name_or_path: str, trust_remote_code: bool = False) -> ModelDims:
    """``AutoConfig.from_pretrained`` (a local dir works offline) -> :func:`dims_from_hf_config`."""
    from transformers import AutoConfig  # local import: the estimator itself needs no transformers

    return dims_from_hf_config(AutoConfig.from_pretrained(name_or_path,
                                                          trust_remote_code=trust_remote_code))
