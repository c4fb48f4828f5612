"""Loading tokenizers and causal LMs (hub id or local path) the way training needs them."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from alignkit.config.schema import LoraConfig as LoraSection
from alignkit.config.schema import ModelConfig
from alignkit.config.values import freeze_problem
from alignkit.errors import ModelError
from alignkit.models.adapter_dirs import adapter_base, is_adapter_dir
from alignkit.models.attention import PACKED_CHOICES, check_installed, resolve
from alignkit.models.sources import model_errors

log = logging.getLogger("alignkit")


@contextlib.contextmanager
def quiet_load_report() -> Iterator[None]:
    """transformers 5 logs a "LOAD REPORT" table (with colour codes) whenever checkpoint and model
    keys differ, on every rank; for a reward model built from a causal LM it reads like an error
    (``lm_head.weight UNEXPECTED / score.weight MISSING``). Callers ask for ``output_loading_info``
    and say what happened in one line (:func:`describe_new_head`)."""
    # A filter, not a higher level: transformers 5.23 runs its tensor-parallel plan check (and logs
    # "layers were not sharded") exactly when this logger's level is WARNING or above.
    hf_log = logging.getLogger("transformers.modeling_utils")
    report = _DropLoadReport()
    hf_log.addFilter(report)
    try:
        yield
    finally:
        hf_log.removeFilter(report)


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """``PeftModel.__init__`` reads transformers' deprecated ``is_gradient_checkpointing`` property
    on every model it wraps (peft 0.21 with transformers 5: a FutureWarning per process that nobody
    can act on). Only that warning is silenced, only around our peft calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.name_or_path
    with model_errors(source):  # a missing model: one line, not a traceback
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token_id is None:
        # Many base models ship without a pad token; EOS is the usual stand-in. Pad positions
        # never reach the loss (targets are IGNORE_INDEX there).
        tok.pad_token = tok.eos_token
    return tok


def attention_for(requested: str) -> str:
    """``auto`` and ``sdpa`` become ``sdpa_packed``: SDPA, except that a packed row attends within each example
    through a varlen kernel or per example (models.attention); a kernel that is not installed is a ConfigError."""
    return resolve(requested)  # type: ignore[return-value]


def plain_attention(requested: str | None) -> str | None:
    """What transformers itself is given for parts that never see packed rows: ``auto`` is its ``sdpa``."""
    check_installed(requested)
    return "sdpa" if requested in PACKED_CHOICES else requested


def load_causal_lm(
    cfg: ModelConfig,
    *,
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    trainable: bool = True,
) -> nn.Module:
    """A causal LM from ``from_pretrained``, configured for training.

    Trainable models keep fp32 master weights (autocast supplies bf16/fp16 compute); frozen
    ones are loaded straight in the compute dtype. With ``model.lora`` the caller may pass the
    compute dtype for a trainable model too: the frozen base is then held in it (half the memory
    of fp32) while the adapters (and any other trainable module) are fp32. The KV cache is
    switched off (it only costs memory in training) and gradient checkpointing is enabled when asked.
    """
    from transformers import AutoModelForCausalLM

    attn = attention_for(cfg.attn_implementation) if cfg.attn_implementation else None
    return _for_training(AutoModelForCausalLM, cfg, name_or_path, dtype, trainable, attn)


def load_vlm(cfg: ModelConfig, *, name_or_path: str | None = None, dtype: torch.dtype = torch.float32,
             trainable: bool = True) -> nn.Module:
    """A vision-language model (LLaVA family: ``AutoModelForImageTextToText``), configured for training
    like :func:`load_causal_lm` (dtype rules, no KV cache, checkpointing, LoRA). ``sdpa`` becomes
    ``sdpa_packed`` for the language model alone (:func:`vlm_attention`)."""
    from transformers import AutoModelForImageTextToText

    attn = vlm_attention(cfg.attn_implementation, cfg.trust_remote_code, name_or_path or cfg.name_or_path)
    return _for_training(AutoModelForImageTextToText, cfg, name_or_path, dtype, trainable, attn)


def vlm_attention(requested: str | None, trust_remote_code: bool, source: str) -> str | dict[str, str] | None:
    """Per-part attention of a VLM: packed rows (``data.packing``) reach its language model, whose
    ``sdpa_packed`` attends per example instead of over a (T, T) block mask of the whole row (2.3x
    faster on a packed shapes micro-batch of 16 rows); the vision tower and the other parts keep the
    requested kernel. transformers takes a dict keyed by sub-config (``text_config``)."""
    if requested not in PACKED_CHOICES:
        return plain_attention(requested)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(adapter_base(source) if is_adapter_dir(source) else source,
                                        trust_remote_code=trust_remote_code)
    if "text_config" not in getattr(config, "sub_configs", {}):
        return plain_attention(requested)
    plain = plain_attention(requested)
    return {"": plain, **{k: plain for k in config.sub_configs}, "text_config": attention_for(requested)}


def _for_training(auto_class: Any, cfg: ModelConfig, name_or_path: str | None, dtype: torch.dtype, trainable: bool,
                  attn: str | None) -> nn.Module:
    """``auto_class.from_pretrained`` in ``dtype``, KV cache off; trainable: checkpointing and new LoRA as configured."""
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if attn:
        kwargs["attn_implementation"] = attn
    model = auto_class.from_pretrained(name_or_path or cfg.name_or_path, **kwargs)
    model.config.use_cache = False
    if trainable:
        if cfg.gradient_checkpointing:
            enable_checkpointing(model)
        if cfg.lora is not None:
            model = apply_lora(model, cfg)
        if cfg.freeze:
            freeze_parameters(model, cfg)
    return model


def freeze_parameters(model: nn.Module, cfg: ModelConfig) -> None:
    """``model.freeze``: every parameter whose name one of the expressions finds (``re.search``) stops training;
    an expression that finds none, or freezing beside LoRA, is one line naming the key."""
    import re

    if problem := freeze_problem(cfg.freeze, cfg.lora):
        raise ModelError(problem)
    params = dict(model.named_parameters())
    for pattern in cfg.freeze:
        found = [n for n in params if re.search(pattern, n)]
        if not found:
            tops = sorted({".".join(n.split(".")[:2 if n.startswith("model.") else 1]) for n in params})
            raise ModelError(f"model.freeze: {pattern!r} matches no parameter of this {type(model).__name__}; its "
                             f"parameters start with {', '.join(tops)}")
        for n in found:
            params[n].requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelError("model.freeze: the expressions freeze every parameter; nothing would train")
    if cfg.gradient_checkpointing:  # checkpointed blocks behind frozen embeddings would see inputs without grad
        model.enable_input_require_grads()


def enable_checkpointing(model: nn.Module) -> None:
    """Activation (gradient) checkpointing, non-reentrant: transformers >= 5 renamed the method."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 4.x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_lora(model: nn.Module, cfg: ModelConfig, task_type: str = "CAUSAL_LM") -> nn.Module:
    from peft import LoraConfig, get_peft_model

    assert cfg.lora is not None
    check_lora_targets(model, cfg.lora.target_modules, model.named_modules())
    if cfg.gradient_checkpointing:
        # With frozen embeddings the checkpointed blocks would see inputs without grad.
        model.enable_input_require_grads()
    lcfg = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        task_type=task_type,
    )
    with quiet_peft():
        return upcast_trainable(get_peft_model(model, lcfg))


#: ``model.lora.target_modules``' default: attention projections most decoders (not all) name so
LORA_DEFAULT = LoraSection().target_modules


def check_lora_targets(model: nn.Module, targets: list[str], modules: Iterable[tuple[str, nn.Module]]) -> None:
    """Each of ``targets`` must name (peft's rule: the whole name or its last dotted parts) a module among
    ``modules`` (``named_modules()`` of the part that gets adapters), else one line naming the missing ones and
    the model's linear layers; peft itself fails with a 50-line traceback when none match and skips a typo
    silently when others do. The default list passes where one of its names matches (e.g. OPT's out_proj)."""
    modules = list(modules)
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n, _ in modules)]
    if not missing or (list(targets) == LORA_DEFAULT and len(missing) < len(targets)):
        return
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
    raise ModelError(f"model.lora.target_modules: {', '.join(missing)} name{'s' if len(missing) == 1 else ''} no "
                     f"module of this {type(model).__name__}; its linear layers: {', '.join(linear)}")


def upcast_trainable(model: nn.Module) -> nn.Module:
    """Trainable parameters in fp32 (the optimizer's master weights), whatever dtype the frozen
    base was loaded in; peft already does this for LoRA layers, not for ``modules_to_save``
    (e.g. a reward model's score head)."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside our training wrappers (for save_pretrained / generate)."""
    while hasattr(model, "hf_model") and isinstance(getattr(model, "hf_model"), nn.Module):
        model = model.hf_model  # type: ignore[assignment]
    return model


def split_lm(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone returning final hidden states, LM head) of a causal LM, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_head = getattr(base, "get_output_embeddings", None)  # a diffusion transformer (FlowPolicy) has no LM head
    head = get_head() if callable(get_head) else None
    backbone = base.base_model if getattr(base, "base_model", base) is not base else None
    if head is None or backbone is None:
        raise TypeError(f"{type(base).__name__}: cannot find the decoder backbone and LM head")
    return backbone, head
