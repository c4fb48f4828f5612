"""``training.liger_layers``: Liger-Kernel's RMSNorm, SwiGLU and RoPE through Liger's own
``apply_liger_kernel_to_llama`` / ``_qwen2``. Liger is Triton (CUDA), so on a CPU the wiring is checked with a
stand-in ``liger_kernel.transformers`` that patches instances the way Liger does (a forward bound into each module's
``__dict__``): the call alignkit makes, that the stand-in forwards run, that the bf16 compute copy of
``model.compute_weights: cast`` (a deep copy) runs its OWN patched forwards, and the one-line refusals. The numerics
against the plain modules in bf16 are gpu tests (tests/integration/test_gpu_steps.py)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from alignkit.distributed.strategy import compute_weights as cw
from alignkit.errors import ConfigError
from alignkit.models import liger
from alignkit.models.liger import apply_liger_layers, check_liger_layers
from tests.conftest import run_cli, write_config
from tests.integration.test_bad_input_cli import one_error_line


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fake ``liger_kernel.transformers`` whose patch functions record their arguments and bind a counting
    forward (the plain one, called through) into every RMSNorm and MLP of the model, as Liger's
    ``_bind_method_to_module`` does."""
    record: dict[str, Any] = {"calls": [], "ran": []}

    def binder(module: torch.nn.Module) -> None:
        plain = type(module).forward

        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            record["ran"].append(self)
            return plain(self, *args, **kwargs)
        module.__dict__["forward"] = forward.__get__(module, type(module))

    def make(name: str) -> Any:
        def patch(**kwargs: Any) -> None:
            record["calls"].append((name, kwargs))
            base = getattr(kwargs["model"], kwargs["model"].base_model_prefix)
            binder(base.norm)
            for layer in base.layers:
                for m in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
                    binder(m)
        return patch

    package, sub = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    sub.apply_liger_kernel_to_llama = make("llama")
    sub.apply_liger_kernel_to_qwen2 = make("qwen2")
    package.transformers = sub
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    return record


def test_liger_layers_wiring_with_a_stand_in(stand_in: dict[str, Any], micro_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(micro_model))
    n_layers = model.config.num_hidden_layers
    assert apply_liger_layers(model) == model.config.model_type == "llama"
    (name, kwargs), = stand_in["calls"]
    assert name == "llama" and kwargs["model"] is model
    assert {k: v for k, v in kwargs.items() if k != "model"} == {
        "rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids)
    assert len(stand_in["ran"]) == 3 * n_layers + 1  # every norm and MLP ran the patched forward
    # bf16 compute weights: the deep copy's modules run their own patched forward, in bf16
    stand_in["ran"].clear()
    master, compute = cw.split(model, torch.bfloat16)
    compute(input_ids=ids)
    ran = {id(m) for m in stand_in["ran"]}
    assert len(stand_in["ran"]) == 3 * n_layers + 1
    assert ran <= {id(m) for m in compute.modules()} and not ran & {id(m) for m in master.modules()}


def test_peft_models_are_patched_inside(stand_in: dict[str, Any], micro_model: Path) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(micro_model)),
                           LoraConfig(r=2, target_modules=["q_proj"]))
    apply_liger_layers(model)
    assert stand_in["calls"][0][1]["model"] is model.get_base_model()


def test_other_model_types_are_refused(stand_in: dict[str, Any]) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    with pytest.raises(ConfigError, match=r"^training.liger_layers: .* llama, qwen2 models, not gpt2; set"):
        apply_liger_layers(gpt2)
    assert not stand_in["calls"]


def test_refusals_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    with pytest.raises(ConfigError, match=r"^training.liger_layers: .* training.fused_layers; set one"):
        check_liger_layers(cuda, fused_layers=True)
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU \(this run's device is cpu\)"):
        check_liger_layers(torch.device("cpu"), fused_layers=False)
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"liger-kernel is not installed: pip install 'alignkit\[liger\]'") as e:
        check_liger_layers(cuda, fused_layers=False)
    assert "\n" not in str(e.value)


def test_cli_refuses_on_cpu_before_any_model_loads(sft_config: dict[str, Any], tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal needs a machine without CUDA")
    sft_config["training"]["liger_layers"] = True
    proc = run_cli(["train", str(write_config(tmp_path / "sft.yaml", sft_config))])
    assert "training.liger_layers: Liger-Kernel is Triton and needs a CUDA GPU" in one_error_line(proc)
    assert "Policy model:" not in proc.stdout + proc.stderr
