"""training.fused_layers (models/fused.py): the memory-lean SwiGLU MLP and RMSNorm forwards give transformers'
losses and gradients to round-off, keep fewer tensors for backward, and apply only where they should."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from alignkit.models.fused import STRATEGIES, apply_fused_layers, fused_layers_on


def _llama(**kw: Any) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, **kw)
    return LlamaForCausalLM(cfg)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fused_llama_gives_the_same_loss_and_gradients_fp32() -> None:
    plain = _llama()
    fused = copy.deepcopy(plain)
    assert apply_fused_layers(fused) == {"mlp": 2, "rmsnorm": 5}  # 2 MLPs; 2 norms per layer + the final one
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(1))
    loss_p, grads_p = _loss_and_grads(plain, ids)
    loss_f, grads_f = _loss_and_grads(fused, ids)
    assert loss_f == pytest.approx(loss_p, rel=1e-6)
    assert grads_f.keys() == grads_p.keys() and len(grads_p) == len(list(plain.parameters()))
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # the names and state dict are untouched (checkpoints load either way)
    assert fused.state_dict().keys() == plain.state_dict().keys()


def test_fused_llama_in_bf16_is_as_close_to_fp32_as_transformers_own() -> None:
    """bf16 round-off differs op by op; the fused gradients must be no further from the fp32 ones than the
    plain bf16 gradients are (with a little slack)."""
    ref = _llama()
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(2))
    _, grads_ref = _loss_and_grads(copy.deepcopy(ref), ids)
    plain = copy.deepcopy(ref).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    apply_fused_layers(fused)
    _, grads_p = _loss_and_grads(plain, ids)
    _, grads_f = _loss_and_grads(fused, ids)

    def err(grads: dict[str, torch.Tensor]) -> float:
        return max(((grads[n] - g).norm() / g.norm()).item() for n, g in grads_ref.items())

    assert err(grads_f) <= 1.5 * err(grads_p) + 1e-3, (err(grads_f), err(grads_p))


def test_frozen_projections_get_no_gradient_and_lora_wrapped_ones_keep_their_forward() -> None:
    from peft import LoraConfig, get_peft_model

    from alignkit.models.loading import quiet_peft

    with quiet_peft():
        attn_only = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        with_mlp = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    plain = copy.deepcopy(attn_only)
    assert apply_fused_layers(attn_only) == {"mlp": 2, "rmsnorm": 5}  # frozen plain MLPs fuse
    assert apply_fused_layers(with_mlp) == {"mlp": 0, "rmsnorm": 5}  # a LoRA-wrapped down_proj: the MLP stays
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    loss_p, grads_p = _loss_and_grads(plain, ids)
    loss_f, grads_f = _loss_and_grads(attn_only, ids)
    assert loss_f == pytest.approx(loss_p, rel=1e-6)
    assert grads_f.keys() == grads_p.keys() and all("lora_" in n for n in grads_p)
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("cls_path", ["transformers.models.mistral.modeling_mistral.MistralRMSNorm",
                                      "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
                                      "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm"])
def test_the_listed_norm_classes_compute_what_the_fused_norm_computes(cls_path: str) -> None:
    import importlib

    module_name, cls_name = cls_path.rsplit(".", 1)
    norm = getattr(importlib.import_module(module_name), cls_name)(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 32)
    expected = norm(x)
    assert apply_fused_layers(norm) == {"mlp": 0, "rmsnorm": 1}
    torch.testing.assert_close(norm(x), expected)


def test_other_norms_and_activations_are_left_alone() -> None:
    gelu = _llama(hidden_act="gelu")
    assert apply_fused_layers(gelu)["mlp"] == 0
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # weight is (1 + w): not Llama's form

    assert apply_fused_layers(GemmaRMSNorm(16)) == {"mlp": 0, "rmsnorm": 0}


def test_fused_layers_apply_where_modules_run_their_own_forward() -> None:
    assert set(STRATEGIES) == {"single", "ddp", "fsdp"}
    assert fused_layers_on(True, "fsdp") and not fused_layers_on(True, "deepspeed")
    assert not fused_layers_on(False, "single") and not fused_layers_on(True, "auto")


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_sft_run_with_fused_layers_equals_plain(sft_config: dict[str, Any], tmp_path: Path) -> None:
    """The whole training path (packed rows, clipping, the chunked LM head) on and off: same losses; the log
    says what was fused."""
    from alignkit.config.loader import load_config
    from alignkit.train.runner import run_train

    from tests.conftest import write_config

    import io
    import logging

    losses, logs = {}, {}
    for on in (True, False):
        cfg = dict(sft_config, output_dir=str(tmp_path / str(on)))
        cfg["data"] = dict(cfg["data"], packing=True)
        cfg["training"] = dict(cfg["training"], fused_layers=on, max_steps=5, max_grad_norm=0.5)
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        logging.getLogger("alignkit").addHandler(handler)
        try:
            run_train(load_config(write_config(tmp_path / f"{on}.yaml", cfg)))
        finally:
            logging.getLogger("alignkit").removeHandler(handler)
        losses[on], logs[on] = _losses(tmp_path / str(on)), stream.getvalue()
    assert len(losses[True]) == 5 and losses[True][-1] < losses[True][0]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert "fused layers: 2 SwiGLU MLPs and 5 RMSNorms of the policy model" in logs[True]
    assert "fused layers" not in logs[False]
