"""FSDP / DeepSpeed configuration: typed sections, the DeepSpeed JSON built from alignkit's own
settings ("auto" filled, disagreements are one-line errors), and FSDP unit discovery."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from alignkit.config import ConfigError
from alignkit.config.loader import apply_overrides, build_dataclass, validate
from alignkit.config.schema import DeepSpeedConfig, RunConfig
from alignkit.distributed.strategy.deepspeed_config import build_deepspeed_config, fill_model_sizes
from tests.conftest import REPO

BASE = {
    "algorithm": "sft",
    "model": {"name_or_path": "some/model"},
    "data": {"train": "builtin:sft_train.jsonl"},
    "training": {"per_device_batch_size": 4},
}


def cfg_from(overrides: list[str]) -> RunConfig:
    import copy

    cfg = build_dataclass(RunConfig, apply_overrides(copy.deepcopy(BASE), overrides))
    validate(cfg)
    return cfg


def build(path: Path | None = None, dtype: torch.dtype = torch.float32, **opts: object) -> dict:
    o = DeepSpeedConfig(config_path=str(path) if path else None, **opts)  # type: ignore[arg-type]
    return build_deepspeed_config(o, per_device=2, accumulation=3, world_size=4, max_grad_norm=0.5, dtype=dtype)


def test_strategy_sections_are_typed() -> None:
    cfg = cfg_from(["distributed.strategy=fsdp", "distributed.fsdp.reshard_after_forward=false",
                    "distributed.fsdp.cpu_offload=true", "distributed.deepspeed.zero_stage=3"])
    assert cfg.distributed.strategy == "fsdp"
    assert cfg.distributed.fsdp.reshard_after_forward is False and cfg.distributed.fsdp.cpu_offload is True
    assert cfg.distributed.deepspeed.zero_stage == 3
    with pytest.raises(ConfigError, match="distributed.deepspeed.zero_stage: must be <= 3"):
        cfg_from(["distributed.deepspeed.zero_stage=4"])
    with pytest.raises(ConfigError, match="distributed.fsdp.reshard"):
        cfg_from(["distributed.fsdp.reshard=false"])  # unknown key, suggestion names the real one
    with pytest.raises(ConfigError, match="distributed.strategy"):
        cfg_from(["distributed.strategy=zero3"])


def test_shard_frozen_is_auto_true_or_false() -> None:
    assert cfg_from([]).distributed.shard_frozen == "auto"
    assert cfg_from(["distributed.shard_frozen=true"]).distributed.shard_frozen is True
    assert cfg_from(["distributed.shard_frozen=false"]).distributed.shard_frozen is False
    with pytest.raises(ConfigError, match="shard_frozen: expected true/false or one of 'auto', got 'maybe'"):
        cfg_from(["distributed.shard_frozen=maybe"])


def test_old_fsdp_shard_frozen_key_still_reads(tmp_path: Path) -> None:
    from alignkit.config import load_config

    over = [f"{k}={v}" for k, v in (("algorithm", "sft"), ("model.name_or_path", "m"),
                                    ("data.train", "builtin:sft_train.jsonl"), ("training.per_device_batch_size", 1))]
    deprecated = "'distributed.fsdp.shard_frozen' is deprecated; use 'distributed.shard_frozen'"
    with pytest.warns(FutureWarning, match=deprecated):
        cfg = load_config(None, [*over, "distributed.fsdp.shard_frozen=true"])
    assert cfg.distributed.shard_frozen is True
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="disagrees with distributed.shard_frozen"):
        load_config(None, [*over, "distributed.fsdp.shard_frozen=true", "distributed.shard_frozen=false"])


def test_frozen_model_engine_config_is_inference_only_zero3() -> None:
    from alignkit.distributed.strategy.deepspeed_config import frozen_model_config, offloads_params

    train = fill_model_sizes(build(REPO / "configs" / "deepspeed" / "zero3.json", torch.bfloat16), hidden_size=64)
    frozen = frozen_model_config(train)
    assert frozen["zero_optimization"]["stage"] == 3 and offloads_params(frozen)  # parameter offload kept
    assert "offload_optimizer" not in frozen["zero_optimization"] and "zero_force_ds_cpu_optimizer" not in frozen
    assert frozen["bf16"] == train["bf16"] and frozen["train_batch_size"] == train["train_batch_size"]
    assert "offload_optimizer" in train["zero_optimization"]  # the training engine's config is untouched
    stage2 = frozen_model_config(build(zero_stage=2, offload_optimizer=True))
    assert stage2["zero_optimization"] == {"stage": 3} and not offloads_params(stage2)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_shipped_configs_fill_every_auto(name: str) -> None:
    ds = fill_model_sizes(build(REPO / "configs" / "deepspeed" / f"{name}.json", torch.bfloat16), hidden_size=64)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 2 * 3 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["zero_optimization"]["stage"] == int(name[-1])
    assert "auto" not in json.dumps(ds)
    if name == "zero3":
        assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
        assert ds["zero_force_ds_cpu_optimizer"] is False  # our torch AdamW, no cpu_adam JIT build
        assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 640


def test_defaults_without_a_file() -> None:
    ds = build()
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    ds = build(zero_stage=3, offload_param=True, offload_optimizer=True)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


@pytest.mark.parametrize(
    ("content", "opts", "pattern"),
    [
        ({"gradient_clipping": 1.0}, {}, r"gradient_clipping=1\.0 disagrees with training\.max_grad_norm=0\.5"),
        ({"train_micro_batch_size_per_gpu": 8}, {}, "train_micro_batch_size_per_gpu=8 disagrees"),
        ({"train_batch_size": 16}, {}, "train_batch_size=16 disagrees"),
        ({"gradient_accumulation_steps": 1}, {}, "gradient_accumulation_steps=1 disagrees"),
        ({"bf16": {"enabled": True}}, {}, "bf16.enabled=True disagrees with model.dtype is fp32"),
        ({"zero_optimization": {"stage": 1}}, {"zero_stage": 3}, "zero_optimization.stage=1 disagrees"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, {}, "needs ZeRO stage 3"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, {}, "needs ZeRO stage 1, 2 or 3"),
        ({"steps_per_print": "auto"}, {}, 'no value for "auto" at steps_per_print'),
    ],
)
def test_disagreement_is_a_one_line_error(tmp_path: Path, content: dict, opts: dict, pattern: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=pattern) as e:
        build(path, **opts)
    assert "\n" not in str(e.value)


def test_matching_concrete_values_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": 0.5, "train_batch_size": 24, "zero_optimization": {"stage": 1}}))
    assert build(path)["zero_optimization"]["stage"] == 1


def test_missing_deepspeed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from alignkit.distributed.strategy.deepspeed import import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(ConfigError, match=r"needs DeepSpeed.*pip install 'alignkit\[deepspeed\]'"):
        import_deepspeed()


def test_cli_reports_a_disagreeing_deepspeed_json(
    tmp_path: Path, micro_model: Path, capsys: pytest.CaptureFixture
) -> None:
    from alignkit.cli import main
    from tests.conftest import write_config

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_clipping": 2.0}))
    cfg = {**BASE, "model": {"name_or_path": str(micro_model)}, "output_dir": str(tmp_path / "run"),
           "training": {**BASE["training"], "max_grad_norm": 1.0},
           "distributed": {"strategy": "deepspeed", "deepspeed": {"config_path": str(ds)}}}
    code = main(["train", str(write_config(tmp_path / "c.yaml", cfg))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2  # at load time, before any engine: the JSON's value where the YAML gives none, else a conflict
    assert err[-1] == ("alignkit: error: ds.json: gradient_clipping=2.0 disagrees with training.max_grad_norm=1.0; "
                       "give one (or set gradient_clipping to \"auto\")")


def test_fsdp_units_are_the_decoder_layers(micro_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from alignkit.config.schema import LoraConfig, ModelConfig
    from alignkit.distributed.strategy.sharded import decoder_blocks, inner_prefix
    from alignkit.models.loading import apply_lora
    from alignkit.models.policy import CausalLMLogps

    hf = AutoModelForCausalLM.from_pretrained(str(micro_model))
    blocks = decoder_blocks(CausalLMLogps(hf))
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * hf.config.num_hidden_layers
    assert inner_prefix(CausalLMLogps(hf)) == "hf_model."
    peft = apply_lora(hf, ModelConfig(name_or_path=str(micro_model), lora=LoraConfig(r=2)))
    wrapped = CausalLMLogps(peft)
    assert [b for b in decoder_blocks(wrapped)] == list(peft.base_model.model.model.layers)
