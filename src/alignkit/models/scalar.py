"""Scalar-head models (reward and cost models): one score per sequence, read at its last token.

The model is a Hugging Face ``AutoModelForSequenceClassification`` with ``num_labels=1`` (for a
causal-LM checkpoint transformers builds the same backbone plus a fresh linear ``score`` head), so
a trained model saves and loads as a standard HF checkpoint. We do not use its own pooling (it
looks for the last non-pad token *id*, which breaks when pad == eos and in packed rows); instead
``forward`` takes ``seq_index`` and reads the final hidden state at each sequence's last position,
the Safe RLHF ``end_scores`` (ALGORITHMS 1.2). Works for right/left padding and packed rows alike.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from alignkit.config.schema import ModelConfig
from alignkit.distributed.env import read_env
from alignkit.errors import ModelError
from alignkit.models.adapter_dirs import adapter_base, adapter_config, is_adapter_dir
from alignkit.models.adapters import attach_adapter
from alignkit.models.loading import (
    apply_lora,
    attention_for,
    enable_checkpointing,
    load_tokenizer,
    quiet_load_report,
    vlm_attention,
)
from alignkit.models.policy import final_hidden
from alignkit.models.vlm import is_vlm_source, lora_on_language_model, register_llava_scorer, train_only
from alignkit.ops.segments import last_positions

HEAD_NAMES = ("score", "classifier")

log = logging.getLogger("alignkit")


def split_scalar(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(backbone returning hidden states, scalar head) of a sequence-classification model, peft or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    head = next((getattr(base, n) for n in HEAD_NAMES if isinstance(getattr(base, n, None), nn.Module)), None)
    if backbone is None or head is None:
        raise TypeError(f"{type(base).__name__}: cannot find the backbone and the score head")
    return backbone, head


class ScalarHeadModel(nn.Module):
    """Wraps an HF sequence-classification model; ``forward`` returns one score per sequence."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model

    def forward(self, input_ids: torch.Tensor, seq_index: torch.Tensor, num_seqs: int,
                positions: torch.Tensor | None = None, target_index: torch.Tensor | None = None,
                **inputs: Any) -> torch.Tensor:
        """Scores ``(S,)`` float32 of the S sequences in ``seq_index`` (``(B, T)``, -1 = pad);
        ``inputs``: any other model inputs (attention_mask, position_ids, pixel_values, ...).

        Only the S hidden states that are scored go through the head. With ``positions`` (a ``(B, T)``
        bool mask) the head scores every marked position instead, ``(N,)`` in row-major order: a PPO
        critic's per-token values V(s_t), read where the policy predicts token t + 1; ``target_index``: the
        same positions as flat indices computed on the host (no boolean mask, no sync).
        """
        backbone, head = split_scalar(self.hf_model)
        hidden = final_hidden(backbone, self.hf_model, input_ids, inputs)  # (B, T, H)
        if positions is not None:
            flat = hidden.reshape(-1, hidden.shape[-1])
            picked = hidden[positions] if target_index is None else flat.index_select(0, target_index)
            return head(picked).squeeze(-1).float()
        last = last_positions(seq_index, num_seqs)  # (S,)
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, last)  # (S, H)
        return head(picked).squeeze(-1).float()


def load_scalar_model(
    cfg: ModelConfig,
    *,
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    trainable: bool = True,
    pad_token_id: int | None = None,
    train_parts: tuple[str, ...] | None = None,
) -> nn.Module:
    """An HF sequence-classification model with one output (a fresh head on a causal LM checkpoint).

    A vision-language model (LLaVA family) gets :class:`~alignkit.models.vlm.LlavaForSequenceClassification`
    (its backbone plus a score head); trainable, only ``train_parts`` of it train (default projector and
    language model, the vision tower frozen) and LoRA goes on its language model only.

    ``name_or_path`` may also be a LoRA adapter directory (a trained reward model saved with
    ``model.lora``): its base is loaded and the adapter (with its score head) attached.
    Trainable models get gradient checkpointing and new LoRA adapters as configured; peft's
    SEQ_CLS task keeps the score head fully trainable and saves it with the adapter
    (``modules_to_save``).
    """
    from transformers import AutoModelForSequenceClassification

    path = name_or_path or cfg.name_or_path
    adapter = path if is_adapter_dir(path) else None
    vlm = is_vlm_source(str(path), cfg.trust_remote_code)
    if vlm:
        register_llava_scorer()
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code, "num_labels": 1}
    if cfg.attn_implementation:  # a VLM: sdpa_packed for its language model alone (models.loading.vlm_attention)
        kwargs["attn_implementation"] = (vlm_attention(cfg.attn_implementation, cfg.trust_remote_code, str(path))
                                         if vlm else attention_for(cfg.attn_implementation))
    with quiet_load_report():
        model, info = AutoModelForSequenceClassification.from_pretrained(
            adapter_base(path) if adapter else path, output_loading_info=True, **kwargs
        )
    if not adapter:  # an adapter directory brings its trained head (modules_to_save)
        describe_new_head(info, path, trainable=trainable)
    model.config.use_cache = False
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    if trainable and cfg.gradient_checkpointing:
        enable_checkpointing(model)
    if adapter:
        return attach_adapter(model, adapter, trainable=trainable)
    if trainable and vlm:  # the parts that train (vision tower frozen by default) + the score head
        parts = tuple(train_parts or ("projector", "language_model"))
        if cfg.lora is not None:
            train_only(model, ())
            return lora_on_language_model(model, cfg, [p for p in parts if p != "language_model"], task_type="SEQ_CLS")
        train_only(model, parts)
        split_scalar(model)[1].requires_grad_(True)
        return model
    if trainable and cfg.lora is not None:
        model = apply_lora(model, cfg, task_type="SEQ_CLS")
    return model


def describe_new_head(info: dict[str, Any], path: str, *, trainable: bool) -> None:
    """transformers' loading report in one line (rank 0): a reward/cost model from a causal-LM
    checkpoint gets a fresh score head and leaves the LM head unused, which is expected when it is
    about to be trained; any other missing or unused weight is worth a warning."""
    missing, unused = list(info.get("missing_keys") or []), list(info.get("unexpected_keys") or [])
    if not (missing or unused) or not read_env().is_main:
        return
    head = [k for k in missing if k.split(".")[0] in HEAD_NAMES]
    lm_head = [k for k in unused if "lm_head" in k.split(".")]  # a VLM's is language_model.lm_head
    other_missing = [k for k in missing if k not in head]
    other_unused = [k for k in unused if k not in lm_head]
    if head and trainable and not other_missing:
        log.info("Reward/cost model: score head initialised fresh" + ("; LM head dropped" if lm_head else ""))
    elif head:
        log.warning(f"{path}: no trained score head in the checkpoint; this frozen model scores with a random head")
    parts = []
    if other_missing:
        parts.append(f"{len(other_missing)} weights missing (initialised fresh, e.g. {other_missing[0]})")
    if other_unused:
        parts.append(f"{len(other_unused)} checkpoint weights unused (e.g. {other_unused[0]})")
    if parts:
        log.warning(f"{path}: " + "; ".join(parts))


def saved_scorer_kind(model_dir: str | Path) -> tuple[bool, Any] | None:
    """(whether it is a reward / cost model, what its config says it is) of a saved model directory (full or
    LoRA adapter); None when the directory holds no config. A causal LM is not one: loaded as a scorer it
    would get a fresh random head, and its scores would mean nothing."""
    import json

    model_dir = Path(model_dir)
    if is_adapter_dir(model_dir):
        kind = adapter_config(model_dir).get("task_type")
        return kind == "SEQ_CLS", kind
    if (model_dir / "config.json").is_file():
        kind = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("architectures")
        return bool(kind) and all(a.endswith("ForSequenceClassification") for a in kind), kind
    return None


def load_scorer(model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[ScalarHeadModel, Any]:
    """A trained reward/cost model (full or adapter directory) and its tokenizer, for scoring."""
    model_dir = Path(model_dir)
    found = saved_scorer_kind(model_dir)
    if found is None:
        raise FileNotFoundError(f"{model_dir}: no config.json or adapter_config.json (not a saved model)")
    ok, kind = found
    if not ok:
        # a causal LM would get a fresh random head here, and its "scores" would mean nothing
        raise ModelError(f"{model_dir} is not a reward/cost model ({kind}); train one with algorithm reward_model or cost_model")
    cfg = ModelConfig(name_or_path=str(model_dir))
    if is_adapter_dir(model_dir) and not (Path(model_dir) / "tokenizer_config.json").is_file():
        cfg.tokenizer = adapter_base(model_dir)
    tok = load_tokenizer(cfg)
    model = ScalarHeadModel(load_scalar_model(cfg, dtype=dtype, trainable=False, pad_token_id=tok.pad_token_id))
    model.eval().requires_grad_(False)
    return model, tok
