"""FSDP2 (``distributed.strategy: fsdp``) on 2 gloo processes, against a single-process run.

All FSDP runs share ONE torchrun launch (workers/train_many.py); the tests below check its
outputs: training == single process for both reshard settings, exact DCP resume, the HF export
(== the DCP-saved weights, loadable by from_pretrained), LoRA (adapter export, DCP without the
frozen base, exact resume, uneven evaluation batches across ranks) and bf16 + CPU offload.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import assert_ok, run_script, write_config
from tests.distributed.runs import derive_config as _cfg
from tests.distributed.runs import final_weights as final
from tests.distributed.runs import max_delta, metric


def losses(run: Path) -> list[float]:
    return metric(run, "loss")

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"
STEPS = 10  # 8 optimizer steps per epoch: the runs cross an epoch boundary


@pytest.fixture(scope="module")
def runs(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fsdp")
    base = {
        "algorithm": "sft",
        "model": {"name_or_path": str(micro_model)},
        "data": {"train": "builtin:sft_train.jsonl", "max_length": 96, "max_train_examples": 64},
        # lr 5e-4: AdamW turns fp32 round-off of near-zero grads into up to ~1% of lr of noise
        "training": {"per_device_batch_size": 4, "learning_rate": 5e-4, "max_steps": STEPS,
                     "lr_scheduler": "cosine", "warmup_steps": 2, "seed": 0, "max_grad_norm": 1.0},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"]},
        "checkpoint": {"save_final": True},
        "distributed": {"strategy": "fsdp"},
    }
    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0}
    configs = [
        _cfg(base, root / "raf1", checkpoint__save_steps=5),
        _cfg(base, root / "raf0", distributed__fsdp__reshard_after_forward=False),
        # training.fused_layers: the fused MLP / RMSNorm forwards inside FSDP2's per-block unshard hooks
        _cfg(base, root / "fused", training__fused_layers=True),
        _cfg(base, root / "resumed", checkpoint__resume_from=str(root / "raf1" / "checkpoint-5")),
        # eval: 5 examples in batches of 2 -> rank 0 runs 2 batches, rank 1 one (lock-step padding)
        _cfg(base, root / "lora", model__lora=lora, training__max_steps=4, checkpoint__save_steps=2,
             data__eval=["builtin:sft_eval.jsonl"], data__max_eval_examples=5, training__eval_batch_size=2),
        _cfg(base, root / "lora_resumed", model__lora=lora, training__max_steps=4,
             checkpoint__resume_from=str(root / "lora" / "checkpoint-2")),
        _cfg(base, root / "bf16_offload", model__dtype="bf16", distributed__fsdp__cpu_offload=True,
             training__max_steps=2),
    ]
    paths = [str(write_config(root / f"{i}.yaml", c)) for i, c in enumerate(configs)]
    proc = run_script(WORKERS / "train_many.py", nproc=2, args=paths, timeout=400)
    assert_ok(proc)

    # the reference: one process, the same global batch of 8, in this process
    from alignkit.config import load_config
    from alignkit.train.runner import run_train

    single = _cfg(base, root / "single", training__per_device_batch_size=8, distributed__strategy="single")
    run_train(load_config(write_config(root / "single.yaml", single)))
    return root


@pytest.mark.parametrize("name", ["raf1", "raf0", "fused"])
def test_fsdp_equals_single_process(runs: Path, name: str) -> None:
    ref = final(runs / "single")
    assert max_delta(ref, final(runs / name)) <= 1e-5
    assert losses(runs / name) == pytest.approx(losses(runs / "single"), abs=1e-5)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(_model_path(runs)).state_dict()
    assert max_delta({k: start[k] for k in ref}, ref) > 1e-3  # training moved the weights >> tolerance


def _model_path(runs: Path) -> str:
    import yaml

    return yaml.safe_load((runs / "0.yaml").read_text())["model"]["name_or_path"]


def test_fsdp_resume_is_exact(runs: Path) -> None:
    assert max_delta(final(runs / "raf1"), final(runs / "resumed")) == 0.0
    assert losses(runs / "resumed") == losses(runs / "raf1")[5:]


def test_fsdp_export_loads_and_equals_dcp_weights(runs: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    ckpt = runs / "raf1" / f"checkpoint-{STEPS}" / "policy"
    dcp_to_torch_save(str(ckpt / "dcp"), str(tmp_path / "full.pt"))
    sharded = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    trained = {k.removeprefix("hf_model."): v for k, v in sharded.items()}
    exported = load_file(str(ckpt / "model.safetensors"))
    assert max_delta(trained, exported) == 0.0
    model = AutoModelForCausalLM.from_pretrained(str(runs / "raf1" / "final"))
    assert max_delta({k: v for k, v in model.state_dict().items() if k in trained}, trained) == 0.0


def test_fsdp_lora_trains_saves_and_resumes_the_adapter(runs: Path) -> None:
    from peft import PeftModel
    from torch.distributed.checkpoint import FileSystemReader

    from alignkit.models.loading import quiet_peft
    from transformers import AutoModelForCausalLM

    run = runs / "lora"
    adapter = load_file(str(run / "final" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 0  # B starts at 0
    assert (run / "checkpoint-2" / "policy" / "adapter_model.safetensors").is_file()
    # DCP holds the adapter and its optimizer state, not the frozen base model
    keys = FileSystemReader(str(run / "checkpoint-2" / "policy" / "dcp")).read_metadata().state_dict_metadata
    assert any("lora_A" in k for k in keys) and not any("base_layer" in k or "embed_tokens" in k for k in keys)
    resumed = load_file(str(runs / "lora_resumed" / "final" / "adapter_model.safetensors"))
    assert max_delta(adapter, resumed) == 0.0
    with quiet_peft():  # peft reads transformers' deprecated is_gradient_checkpointing on every wrap
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(_model_path(runs)), str(run / "final"))
    sd = model.state_dict()
    some = next(k for k in adapter if "lora_B" in k)
    assert torch.equal(sd[some.replace(".weight", ".default.weight")], adapter[some])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/loss" in r for r in rows)  # uneven eval batches across ranks did not hang


def test_fsdp_bf16_mixed_precision_with_cpu_offload(runs: Path) -> None:
    run = runs / "bf16_offload"
    assert len(losses(run)) == 2 and all(math.isfinite(x) for x in losses(run))
    w = final(run)
    assert all(torch.isfinite(v).all() for v in w.values())
