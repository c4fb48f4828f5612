"""Reward/cost heads: the score is read at each sequence's last non-pad token in every layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignkit.config.schema import LoraConfig, ModelConfig
from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import TokenCollator
from alignkit.models.scalar import ScalarHeadModel, load_scalar_model, load_scorer
from alignkit.ops.segments import last_positions, seq_index_from_attention_mask

SEQS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15], [16, 17, 18]]


def test_last_positions_right_left_and_packed() -> None:
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    assert last_positions(seq_index_from_attention_mask(right), 3).tolist() == [2, 5, 11]
    left = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]])
    assert last_positions(seq_index_from_attention_mask(left), 3).tolist() == [3, 7, 11]
    packed = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert last_positions(packed, 3).tolist() == [2, 4, 8]
    # no device read to check it: a sequence without a position is -1, and the collator refuses one on the host
    assert last_positions(packed, 4).tolist() == [2, 4, 8, -1]
    for packing in (False, True):
        with pytest.raises(ValueError, match="example 1 of the micro-batch has no tokens"):
            TokenCollator(0, packed=packing)([{"input_ids": [5], "labels": [5]}, {"input_ids": [], "labels": []}])


@pytest.fixture(scope="module")
def rm(micro_model: Path) -> ScalarHeadModel:
    torch.manual_seed(0)
    model = ScalarHeadModel(load_scalar_model(ModelConfig(name_or_path=str(micro_model)), trainable=False, pad_token_id=0))
    return model.eval()


def one_by_one(rm: ScalarHeadModel) -> torch.Tensor:
    out = []
    for s in SEQS:
        ids = torch.tensor([s])
        out.append(rm(input_ids=ids, seq_index=torch.zeros_like(ids), num_seqs=1))
    return torch.cat(out)


@torch.no_grad()
def test_scores_agree_across_layouts(rm: ScalarHeadModel) -> None:
    ref = one_by_one(rm)
    examples = [{"input_ids": s, "labels": [IGNORE_INDEX] * len(s)} for s in SEQS]
    # right padding
    b = TokenCollator(0, packed=False)(examples)
    right = rm(input_ids=b["input_ids"], seq_index=b["seq_index"], num_seqs=4, attention_mask=b["attention_mask"])
    # left padding (positions count real tokens only, as generation does)
    width = max(map(len, SEQS))
    ids = torch.tensor([[0] * (width - len(s)) + s for s in SEQS])
    attn = (torch.arange(width)[None] >= torch.tensor([width - len(s) for s in SEQS])[:, None]).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    left = rm(input_ids=ids, seq_index=seq_index_from_attention_mask(attn), num_seqs=4, attention_mask=attn,
              position_ids=pos)
    # packed, padding-free
    p = TokenCollator(0, packed=True)(examples)
    packed = rm(input_ids=p["input_ids"], seq_index=p["seq_index"], num_seqs=4, position_ids=p["position_ids"])
    for got in (right, left, packed):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # and the same as transformers' own sequence-classification pooling (right padding, pad id 0)
    hf = rm.hf_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.squeeze(-1)
    torch.testing.assert_close(hf, ref, rtol=1e-5, atol=1e-5)


def test_lora_reward_model_trains_and_saves_its_head(micro_model: Path, tmp_path: Path) -> None:
    cfg = ModelConfig(name_or_path=str(micro_model), lora=LoraConfig(r=4, alpha=8, dropout=0.0))
    torch.manual_seed(0)
    model = ScalarHeadModel(load_scalar_model(cfg, pad_token_id=0))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable) and any("lora_" in n for n in trainable)
    assert not any("embed_tokens" in n for n in trainable)
    with torch.no_grad():  # make the adapter matter
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    model.hf_model.save_pretrained(tmp_path / "adapter")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(micro_model).save_pretrained(tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")).keys()
    assert any("score" in k for k in keys)  # the head travels with the adapter (modules_to_save)
    reloaded, _ = load_scorer(tmp_path / "adapter")
    ids = torch.tensor([SEQS[0]])
    with torch.no_grad():
        a = model.eval()(input_ids=ids, seq_index=torch.zeros_like(ids), num_seqs=1)
        b = reloaded(input_ids=ids, seq_index=torch.zeros_like(ids), num_seqs=1)
    torch.testing.assert_close(a, b)
