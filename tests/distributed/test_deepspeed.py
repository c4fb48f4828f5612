"""DeepSpeed ZeRO 0-3 (``distributed.strategy: deepspeed``) on 2 gloo processes, against DDP.

Skipped when deepspeed is not importable (``DS_BUILD_OPS=0 pip install deepspeed``). All runs
share ONE torchrun launch (the seed guide's zero2.json too); accumulation 2 with micro-batches of unequal token counts checks that
the engine's accumulation boundary and loss scaling match alignkit's loop. ZeRO-1 and ZeRO-3
use the shipped configs/deepspeed/*.json (ZeRO-3 offloads optimizer and parameters to the CPU).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO, assert_ok, run_script, write_config
from tests.distributed.runs import derive_config as _cfg
from tests.distributed.runs import final_weights as final
from tests.distributed.runs import max_delta
from tests.distributed.runs import metric as metrics
from tests.distributed.workers.train_many import output_of

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"
STEPS = 6
STAGES = ["z0", "z1", "z2", "z3"]


@pytest.fixture(scope="module")
def runs(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("deepspeed")
    base = {
        "algorithm": "sft",
        "model": {"name_or_path": str(micro_model)},
        "data": {"train": "builtin:sft_train.jsonl", "max_length": 96, "max_train_examples": 64},
        "training": {"per_device_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 5e-4,
                     "max_steps": STEPS, "lr_scheduler": "cosine", "warmup_steps": 2, "seed": 0,
                     "max_grad_norm": 1.0},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"]},
        "checkpoint": {"save_final": True},
    }
    ds = {"strategy": "deepspeed"}
    zero1, zero3 = str(REPO / "configs/deepspeed/zero1.json"), str(REPO / "configs/deepspeed/zero3.json")
    configs = [
        _cfg(base, root / "ddp", distributed={"strategy": "ddp"}),
        _cfg(base, root / "z0", distributed={**ds, "deepspeed": {"zero_stage": 0}}),
        _cfg(base, root / "z1", distributed={**ds, "deepspeed": {"config_path": zero1}}),
        _cfg(base, root / "z2", distributed={**ds, "deepspeed": {"zero_stage": 2}}, checkpoint__save_steps=3),
        _cfg(base, root / "z2_resumed", distributed={**ds, "deepspeed": {"zero_stage": 2}},
             checkpoint__resume_from=str(root / "z2" / "checkpoint-3")),
        _cfg(base, root / "z3", distributed={**ds, "deepspeed": {"config_path": zero3}},
             checkpoint__save_steps=3),
        _cfg(base, root / "z3_resumed", distributed={**ds, "deepspeed": {"config_path": zero3}},
             checkpoint__resume_from=str(root / "z3" / "checkpoint-3")),
        _cfg(base, root / "bf16", distributed={**ds, "deepspeed": {"zero_stage": 2}}, model__dtype="bf16",
             training__max_steps=2),
    ]
    paths = [str(write_config(root / f"{i}.yaml", c)) for i, c in enumerate(configs)]
    seed_guide = str(_seed_guide_config(micro_model, root))  # one more run in the same launch
    proc = run_script(WORKERS / "train_many.py", nproc=2, args=[*paths, seed_guide], timeout=600)
    assert_ok(proc)
    (root / "seed_guide.stderr").write_text(output_of(proc.stderr, seed_guide))
    return root


@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_equals_ddp(runs: Path, stage: str) -> None:
    assert max_delta(final(runs / "ddp"), final(runs / stage)) <= 1e-5
    assert metrics(runs / stage, "loss") == pytest.approx(metrics(runs / "ddp", "loss"), abs=1e-5)
    # the engine's clipping (gradient_clipping = training.max_grad_norm) sees the same norm as DDP
    assert metrics(runs / stage, "grad_norm") == pytest.approx(metrics(runs / "ddp", "grad_norm"), rel=1e-4)


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_zero_checkpoint_resume_is_exact(runs: Path, stage: str) -> None:
    assert (runs / stage / "checkpoint-3" / "policy" / "deepspeed" / "state").is_dir()
    assert max_delta(final(runs / stage), final(runs / f"{stage}_resumed")) == 0.0
    assert metrics(runs / f"{stage}_resumed", "loss") == metrics(runs / stage, "loss")[3:]


def test_zero3_export_equals_fp32_master_weights(runs: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    ckpt = runs / "z3" / f"checkpoint-{STEPS}" / "policy"
    master = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "deepspeed"), tag="state")
    master = {k.removeprefix("hf_model."): v for k, v in master.items()}
    assert max_delta(master, load_file(str(ckpt / "model.safetensors"))) == 0.0
    model = AutoModelForCausalLM.from_pretrained(str(runs / "z3" / "final"))
    assert max_delta({k: v for k, v in model.state_dict().items() if k in master}, master) == 0.0


def test_bf16_trains(runs: Path) -> None:
    loss = metrics(runs / "bf16", "loss")
    assert len(loss) == 2 and all(math.isfinite(x) for x in loss)


def _seed_guide_config(micro_model: Path, root: Path) -> Path:
    """The seed guide's own zero2.json (optimizer AdamW, scheduler WarmupLR, fp16, concrete batch sizes;
    train_batch_size set for these 2 processes) as a run of 2 steps."""
    seed = json.loads((REPO / "tests/unit/fixtures/seed_deepspeed/zero2.json").read_text())
    seed.update(train_batch_size=8, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    seed["scheduler"]["params"]["warmup_num_steps"] = 4
    ds = root / "zero2.json"
    ds.write_text(json.dumps(seed))
    cfg = {"algorithm": "sft", "output_dir": str(root / "seed_guide"), "model_name_or_path": str(micro_model),
           "deepspeed": str(ds), "max_steps": 2,
           "data": {"train": "builtin:sft_train.jsonl", "max_length": 64, "max_train_examples": 32},
           "logging": {"logging_steps": 1, "report_to": ["console", "jsonl"]}}
    return write_config(root / "seed_guide.yaml", cfg)


def test_seed_guide_zero2_json_trains(runs: Path) -> None:
    """The seed guide's zero2.json trains 2 steps: its values are read into training.* (each said once, by rank
    0), fp16 is said to be ignored on CPU, the engine gets alignkit's AdamW (the run's own lines of the launch)."""
    stderr = (runs / "seed_guide.stderr").read_text()
    for line in ("config: zero2.json optimizer AdamW read as training.learning_rate=3e-05",
                 ("config: zero2.json scheduler WarmupLR read as training.lr_scheduler=constant, "
                  "training.warmup_steps=4"),
                 "config: zero2.json batch read as training.per_device_batch_size=2",
                 "config: zero2.json fp16.enabled=true is ignored on this CPU run",
                 "Effective batch size: 8 (per_device=2 x accumulation=2 x 2 processes)"):
        assert stderr.count(line) == 1, (line, stderr[-3000:])
    assert metrics(runs / "seed_guide", "lr") == pytest.approx([3e-5 / 4, 2 * 3e-5 / 4])  # linear warmup, 4 steps
    assert all(math.isfinite(x) for x in metrics(runs / "seed_guide", "loss"))
