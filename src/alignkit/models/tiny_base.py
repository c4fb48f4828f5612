"""What every tiny model shares: a byte-level BPE tokenizer trained on a corpus the package ships, the sizes,
the Llama config (``models/tiny.py`` builds the models: the Llama, and through ``tiny_vlm.py`` / ``tiny_sd3.py``
the LLaVA and the SD3 pipeline, which build on these parts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from alignkit.errors import ConfigError
from alignkit.resources import resource_path

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
IM_START = "<|im_start|>"
#: End of a chat turn, and the tokenizer's eos: SFT must learn to stop where the assistant turn ends.
IM_END = "<|im_end|>"
#: In this order they get ids 0, 1, 2, 3.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, IM_START, IM_END)

#: ChatML without a bos token; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: ``llava``: a tiny vision-language model around the tiny Llama (:mod:`alignkit.models.tiny_vlm`); ``sd3``: a
#: tiny flow-matching text-to-image pipeline in diffusers' format (:mod:`alignkit.models.tiny_sd3`).
ARCHS: tuple[str, ...] = ("llama", "llava", "sd3")

#: Model shapes. ``vocab_size`` is the tokenizer target; the model uses ``len(tokenizer)``.
SIZES: dict[str, dict[str, int]] = {
    # ~0.2M parameters: for fast unit tests.
    "micro": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 1024},
    # ~0.5M parameters: micro with 64-wide attention heads, for engines whose kernels refuse head_dim 16
    # (vLLM's CPU attention: "Unsupported CPU attention configuration: head_dim=16").
    "micro64": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 2, "intermediate_size": 352, "vocab_size": 1024},
    # ~7M parameters: learns the synthetic tasks in minutes on a CPU.
    "tiny": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 4, "intermediate_size": 688, "vocab_size": 8192},
    # ~69M parameters: for throughput and memory benchmarks.
    "small": {"hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 12,
              "num_key_value_heads": 12, "intermediate_size": 2048, "vocab_size": 8192},
}


def default_corpus() -> Path:
    """The tokenizer corpus shipped in ``alignkit/resources/corpus.txt``."""
    return resource_path("corpus.txt")


def train_tokenizer(vocab_size: int = 8192, corpus: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (deterministic: same corpus and size, same tokenizer).

    Digits are split one per token before the byte-level step, so ``"68"`` is ``["6", "8"]`` and
    the per-digit arithmetic of the ``add`` task is learnable. No token is added automatically (no
    bos/eos post-processing); chat structure comes from ``chat_template`` alone. If the corpus runs
    out of merges first, ``len(tokenizer) < vocab_size``.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    path = Path(corpus) if corpus is not None else default_corpus()
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer corpus not found: {path}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes, so any text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = path.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START],
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        padding_side="right",
        model_max_length=2048,
        chat_template=CHAT_TEMPLATE,
    )


def _check_choice(what: str, value: str, choices: Any) -> None:
    """Raise ``ValueError`` naming the valid choices when ``value`` is not one of them."""
    if value not in choices:
        raise ConfigError(f"unknown {what} {value!r}; choose from {', '.join(choices)}")


def tiny_config(tokenizer: PreTrainedTokenizerFast, size: str = "tiny", arch: str = "llama") -> LlamaConfig:
    """The model config of ``size`` whose vocabulary and special ids match ``tokenizer``."""
    _check_choice("arch", arch, ARCHS)
    _check_choice("size", size, SIZES)
    if arch != "llama":
        raise ConfigError(f"tiny_config builds the Llama; {arch!r} models come from build_tiny_model")
    dims = {k: v for k, v in SIZES[size].items() if k != "vocab_size"}
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
        **dims,
    )
