"""benchmarks/trl_varlen.py: the attention TRL's padding-free rows get in the benchmarks (issue 49, part 3).
A packed row (position_ids restarting, no attention mask) through the registered function gives each example
the logits it has alone, on tiny Qwen2 and Llama models; plain SDPA on the same packed row does not (the reason
the function exists), and padded batches keep SDPA's answer."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import trl_varlen  # noqa: E402

LENGTHS = (5, 9, 3, 7)
DIMS = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _model(arch: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cls, cfg = {"qwen2": (Qwen2ForCausalLM, Qwen2Config), "llama": (LlamaForCausalLM, LlamaConfig)}[arch]
    return cls(cfg(**DIMS, attn_implementation=attn)).eval()


def _rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 97, (n,), generator=g) for n in LENGTHS]


def _packed_logits(model: torch.nn.Module, rows: list[torch.Tensor]) -> torch.Tensor:
    ids = torch.cat(rows)[None]
    pos = torch.cat([torch.arange(len(r)) for r in rows])[None]
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos).logits[0]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_row_matches_rows_run_separately(arch: str) -> None:
    name = trl_varlen.register()
    model = _model(arch, name)
    trl_varlen.forget_each_forward(model)
    rows = _rows()
    with torch.no_grad():
        alone = torch.cat([model(input_ids=r[None]).logits[0] for r in rows])
    torch.testing.assert_close(_packed_logits(model, rows), alone, rtol=1e-5, atol=1e-5)
    # the same weights under plain SDPA: later examples attend to earlier ones (what TRL's SDPA rows train on)
    sdpa = _model(arch, "sdpa")
    sdpa.load_state_dict(model.state_dict())
    wrong = _packed_logits(sdpa, rows)
    first = LENGTHS[0]
    torch.testing.assert_close(wrong[:first], alone[:first], rtol=1e-5, atol=1e-5)
    assert (wrong[first:] - alone[first:]).abs().max() > 1e-2


def test_boundaries_and_padded_batches() -> None:
    cu, longest, lengths = trl_varlen.boundaries(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 9] and longest == 4 and lengths == [3, 2, 4]
    name = trl_varlen.register()
    model, sdpa = _model("qwen2", name), _model("qwen2", "sdpa")
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])  # left padding
    with torch.no_grad():
        got, want = model(input_ids=ids, attention_mask=mask).logits, sdpa(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-5, atol=1e-5)
