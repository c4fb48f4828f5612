"""A DeepSpeed JSON users already have (the seed guide's zero1/2/3.json with optimizer AdamW, scheduler
WarmupLR, fp16 and concrete batch sizes) is read into training.* at load time, one note per section;
a YAML value that disagrees is a one-line error; the engine config keeps neither section."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from alignkit.config import ConfigError, load_config
from alignkit.config.deepspeed_json import map_deepspeed_json
from alignkit.config.schema import DeepSpeedConfig
from alignkit.distributed.strategy.deepspeed_config import build_deepspeed_config
from tests.conftest import REPO, write_config

SEEDS = Path(__file__).parents[1] / "fixtures" / "seed_deepspeed"
REQUIRED = {"algorithm": "sft", "model": {"name_or_path": "some/model"}, "data": {"train": "builtin:sft_train.jsonl"}}


def raw_with(path: Path | str, **sections: Any) -> dict[str, Any]:
    raw = copy.deepcopy(REQUIRED)
    raw["distributed"] = {"strategy": "deepspeed", "deepspeed": {"config_path": str(path)}}
    for k, v in sections.items():
        raw[k] = v
    return raw


def ds_file(tmp_path: Path, content: dict[str, Any]) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_seed_json_is_read_into_training(name: str) -> None:
    raw = raw_with(SEEDS / f"{name}.json")
    notes = map_deepspeed_json(raw, cuda=False)
    t = raw["training"]
    assert t == {"learning_rate": 3e-5, "adam_beta1": 0.8, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
                 "weight_decay": 3e-7, "lr_scheduler": "constant", "warmup_steps": 500,
                 "per_device_batch_size": 4, "gradient_accumulation_steps": 8, "max_grad_norm": 1.0}
    assert "dtype" not in raw["model"]  # fp16 cannot run on CPU: model.dtype stays auto
    assert notes == [
        f"config: {name}.json optimizer AdamW read as training.learning_rate=3e-05, training.adam_beta1=0.8, "
        "training.adam_beta2=0.999, training.adam_epsilon=1e-08, training.weight_decay=3e-07 (alignkit's torch AdamW; "
        "no decay on biases and norms)",
        f"config: {name}.json scheduler WarmupLR read as training.lr_scheduler=constant, training.warmup_steps=500 "
        "(linear warmup; DeepSpeed's default is log)",
        f"config: {name}.json batch read as training.per_device_batch_size=4, training.gradient_accumulation_steps=8, "
        "training.max_grad_norm=1.0 (train_batch_size=32 must equal per device x accumulation x processes)",
        f"config: {name}.json fp16.enabled=true is ignored on this CPU run: DeepSpeed cannot train in fp16 on CPU "
        "(model.dtype stays auto)",
    ]


def test_fp16_is_taken_where_cuda_can_run_it() -> None:
    raw = raw_with(SEEDS / "zero2.json")
    notes = map_deepspeed_json(raw, cuda=True)
    assert raw["model"]["dtype"] == "fp16" and notes[-1] == "config: zero2.json fp16 read as model.dtype=fp16"


def test_load_config_and_engine_config_from_the_seed_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the seed guide's YAML beside its JSON: the same batch and lr, given in HF keys under training:
    path = write_config(tmp_path / "c.yaml", {**REQUIRED, "training": {
        "distributed_strategy": "deepspeed", "deepspeed": {"config_path": str(SEEDS / "zero2.json")},
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8, "learning_rate": "3e-5"}})
    cfg = load_config(path)
    t = cfg.training
    assert (t.learning_rate, t.adam_beta1, t.weight_decay, t.lr_scheduler, t.warmup_steps) == (3e-5, 0.8, 3e-7,
                                                                                               "constant", 500)
    assert cfg.distributed.strategy == "deepspeed" and cfg.model.dtype == "auto"
    opts = cfg.distributed.deepspeed
    ds = build_deepspeed_config(opts, per_device=4, accumulation=8, world_size=1, max_grad_norm=1.0,
                                dtype=torch.float32)
    assert "optimizer" not in ds and "scheduler" not in ds  # the engine gets alignkit's torch AdamW
    assert ds["fp16"]["enabled"] is False and ds["bf16"]["enabled"] is False
    assert ds["train_batch_size"] == 32 and ds["zero_optimization"]["stage"] == 2
    with pytest.raises(ConfigError, match=r"zero2.json: train_batch_size=32 disagrees with per_device x accumulation "
                                          r"x world=64"):
        build_deepspeed_config(opts, per_device=4, accumulation=8, world_size=2, max_grad_norm=1.0, dtype=torch.float32)


@pytest.mark.parametrize(
    ("content", "sections", "pattern"),
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-5}}}, {"training": {"learning_rate": 1e-4}},
         r"^ds.json: optimizer.params.lr=3e-05 disagrees with training.learning_rate=0.0001; give one"),
        ({"gradient_accumulation_steps": 8}, {"training": {"gradient_accumulation_steps": 2}},
         r"^ds.json: gradient_accumulation_steps=8 disagrees with training.gradient_accumulation_steps=2"),
        ({"train_micro_batch_size_per_gpu": 4}, {"training": {"per_device_batch_size": 2}},
         r"train_micro_batch_size_per_gpu=4 disagrees with training.per_device_batch_size=2"),
        ({"train_batch_size": 32}, {"training": {"global_batch_size": 64}},
         r"train_batch_size=32 disagrees with training.global_batch_size=64"),
        ({"bf16": {"enabled": True}}, {"model": {"name_or_path": "m", "dtype": "fp32"}},
         r"bf16.enabled=true disagrees with model.dtype=fp32"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}, {"training": {"warmup_ratio": 0.1}},
         r"warmup_num_steps=100 and training.warmup_ratio=0.1 both set the warmup"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000}}}, {"training": {"epochs": 3}},
         r"total_num_steps=1000 and training.epochs=3 both fix the run length"),
        ({"optimizer": {"type": "Lamb"}}, {}, r"optimizer type 'Lamb' has no alignkit equivalent"),
        ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}}, {},
         r"adam_w_mode=false \(L2 weight decay\) cannot be honoured"),
        ({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}}, {}, r"optimizer.params.momentum is not read"),
        ({"scheduler": {"type": "OneCycle"}}, {}, r"scheduler type 'OneCycle' has no alignkit equivalent"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, {}, r"both true"),
    ],
)
def test_conflict_or_unsupported_value_is_a_one_line_error(tmp_path: Path, content: dict, sections: dict,
                                                           pattern: str) -> None:
    raw = raw_with(ds_file(tmp_path, content), **sections)
    raw["model"] = {**REQUIRED["model"], **raw["model"]}
    with pytest.raises(ConfigError, match=pattern) as e:
        map_deepspeed_json(raw, cuda=True)
    assert "\n" not in str(e.value)


def test_equal_yaml_values_and_autos_are_accepted(tmp_path: Path) -> None:
    raw = raw_with(SEEDS / "zero2.json", training={"learning_rate": "3e-5", "per_device_batch_size": 4,
                                                   "gradient_accumulation_steps": 8, "warmup_steps": 500})
    map_deepspeed_json(raw, cuda=False)
    assert raw["training"]["learning_rate"] == "3e-5"  # the YAML's own value is kept
    shipped = raw_with(REPO / "configs" / "deepspeed" / "zero3.json")  # every value "auto": nothing to read
    assert map_deepspeed_json(shipped) == [] and "training" not in shipped


def test_warmup_decay_and_cosine_schedules(tmp_path: Path) -> None:
    decay = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
             "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4,
                                                               "warmup_num_steps": 10, "warmup_type": "linear",
                                                               "total_num_steps": 100}}}
    raw = raw_with(ds_file(tmp_path, decay))
    notes = map_deepspeed_json(raw, cuda=False)
    assert raw["training"] == {"learning_rate": 2e-4, "lr_scheduler": "linear", "warmup_steps": 10,
                               "min_lr_ratio": pytest.approx(0.05), "max_steps": 100}
    assert "scheduler.params.warmup_max_lr overrides optimizer lr=0.0001, as in DeepSpeed" in notes[0]
    cosine = {"optimizer": {"type": "Adam", "params": {"lr": 5e-5}},
              "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 20, "cos_min_ratio": 0.1,
                                                                 "total_num_steps": "auto"}}}
    raw = raw_with(ds_file(tmp_path, cosine), training={"max_steps": 300})
    map_deepspeed_json(raw, cuda=False)
    assert raw["training"] == {"max_steps": 300, "learning_rate": 5e-5, "lr_scheduler": "cosine", "warmup_steps": 20,
                               "min_lr_ratio": 0.1}


def test_global_batch_from_the_json_when_it_gives_no_micro_batch(tmp_path: Path) -> None:
    raw = raw_with(ds_file(tmp_path, {"train_batch_size": 64, "gradient_accumulation_steps": 2}))
    map_deepspeed_json(raw, cuda=False)
    assert raw["training"] == {"gradient_accumulation_steps": 2, "global_batch_size": 64}


def test_engine_config_drops_mapped_sections_even_for_a_direct_build(tmp_path: Path) -> None:
    path = ds_file(tmp_path, {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}})
    ds = build_deepspeed_config(DeepSpeedConfig(config_path=str(path)), per_device=1, accumulation=1, world_size=1,
                                max_grad_norm=1.0, dtype=torch.float32)
    assert "optimizer" not in ds and "scheduler" not in ds


def test_validate_shows_the_json_values_and_checks_its_batch_rule(micro_model: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    from alignkit.cli import main

    cfg = {**REQUIRED, "model": {"name_or_path": str(micro_model)}, "deepspeed": str(SEEDS / "zero1.json"),
           "data": {"train": "builtin:sft_train.jsonl", "max_train_examples": 64}}
    path = str(write_config(tmp_path / "c.yaml", cfg))
    assert main(["validate", path, "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "learning_rate: 3.0e-05" in out and "warmup_steps: 500" in out
    assert "effective batch                      32 (per_device=4 x accumulation=8 x 1 processes)" in out
    assert main(["validate", path, "--world-size", "2"]) == 2  # the seed's 32 = 4 x 8 holds for one process
    err = capsys.readouterr().err
    assert "zero1.json: train_batch_size=32 disagrees with per_device x accumulation x world=64" in err
