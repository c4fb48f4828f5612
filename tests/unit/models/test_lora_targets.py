"""model.lora.target_modules checked against the model before peft sees them (issue 42.2)."""

from __future__ import annotations

import pytest
from torch import nn

from alignkit.errors import ModelError
from alignkit.models.loading import check_lora_targets


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(4, 4) for _ in range(4))


class OPTLike(nn.Module):
    """OPT names its attention output out_proj: the default list matches three of its four names."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"self_attn": Attention(), "norm": nn.LayerNorm(4)})])
        self.fc1 = nn.Linear(4, 8)


def test_a_partly_matching_default_passes_an_explicit_miss_does_not() -> None:
    model = OPTLike()
    check_lora_targets(model, ["q_proj", "k_proj", "v_proj", "o_proj"], model.named_modules())  # the default
    check_lora_targets(model, ["self_attn.q_proj", "fc1"], model.named_modules())  # dotted suffixes match
    with pytest.raises(ModelError) as e:
        check_lora_targets(model, ["q_proj", "o_proj", "gate_proj"], model.named_modules())
    assert str(e.value) == ("model.lora.target_modules: o_proj, gate_proj name no module of this OPTLike; its "
                            "linear layers: fc1, k_proj, out_proj, q_proj, v_proj")
    with pytest.raises(ModelError, match="model.lora.target_modules: proj names no module"):
        check_lora_targets(model, ["proj"], model.named_modules())  # a part of a name is no match (peft's rule)
