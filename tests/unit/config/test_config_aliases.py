"""Config keys users already have (HF TrainingArguments, the seed guides): every alias maps to its
native key with one note, conflicts are one-line errors, overrides win, ``alignkit migrate`` round-trips."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from alignkit.config import ConfigError, load_config
from alignkit.config.aliases import ALIASES, REWARD, TOP, TRAINING, apply_aliases
from alignkit.config.loader import build_dataclass
from alignkit.config.migrate import migrate_raw
from alignkit.config.schema import RunConfig
from tests.conftest import REPO, write_config

REQUIRED = {"algorithm": "sft", "model": {"name_or_path": "some/model"}, "data": {"train": "builtin:sft_train.jsonl"}}


def native(raw: dict[str, Any]) -> tuple[RunConfig, list[str]]:
    out, notes = apply_aliases(copy.deepcopy(raw))
    return build_dataclass(RunConfig, out), notes


def value(cfg: RunConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


# (the config as users write it, the native values it must give)
CASES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"per_device_train_batch_size": 4}, {"training.per_device_batch_size": 4}),
    ({"training": {"per_device_train_batch_size": 2}}, {"training.per_device_batch_size": 2}),
    ({"per_device_eval_batch_size": 8}, {"training.eval_batch_size": 8}),
    ({"training": {"per_device_eval_batch_size": 8}}, {"training.eval_batch_size": 8}),
    ({"gradient_accumulation_steps": 3}, {"training.gradient_accumulation_steps": 3}),
    ({"accumulation_steps": 4}, {"training.gradient_accumulation_steps": 4}),
    ({"training": {"accumulation_steps": 4}}, {"training.gradient_accumulation_steps": 4}),
    ({"batch_size": 8}, {"training.per_device_batch_size": 8, "training.global_batch_size": None}),
    ({"training": {"batch_size": 32}}, {"training.global_batch_size": 32, "training.per_device_batch_size": None}),
    ({"training": {"dataloader": {"batch_size": 8, "num_workers": 4, "pin_memory": True}}},
     {"training.per_device_batch_size": 8, "data.num_workers": 4}),
    ({"dataloader": {"batch_size": 2}}, {"training.per_device_batch_size": 2}),
    ({"num_train_epochs": 3}, {"training.epochs": 3.0}),
    ({"training": {"num_train_epochs": 2}}, {"training.epochs": 2.0}),
    ({"max_steps": 100}, {"training.max_steps": 100}),
    ({"max_steps": -1}, {"training.max_steps": None}),
    ({"learning_rate": "3e-5"}, {"training.learning_rate": 3e-5}),
    ({"lr_scheduler_type": "cosine"}, {"training.lr_scheduler": "cosine"}),
    ({"training": {"lr_scheduler_type": "constant_with_warmup"}}, {"training.lr_scheduler": "constant"}),
    ({"warmup_ratio": 0.1}, {"training.warmup_ratio": 0.1}),
    ({"warmup_steps": 50}, {"training.warmup_steps": 50}),
    ({"weight_decay": 0.01}, {"training.weight_decay": 0.01}),
    ({"max_grad_norm": 0.5}, {"training.max_grad_norm": 0.5}),
    ({"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6},
     {"training.adam_beta1": 0.8, "training.adam_beta2": 0.95, "training.adam_epsilon": 1e-6}),
    ({"seed": 7}, {"training.seed": 7}),
    ({"eval_steps": 20}, {"training.eval_steps": 20}),
    ({"model_name_or_path": "org/m", "model": {}}, {"model.name_or_path": "org/m"}),
    ({"training": {"model_name_or_path": "org/m"}, "model": {}}, {"model.name_or_path": "org/m"}),
    ({"gradient_checkpointing": True}, {"model.gradient_checkpointing": True}),
    ({"training": {"gradient_checkpointing": True}}, {"model.gradient_checkpointing": True}),
    ({"bf16": True}, {"model.dtype": "bf16"}),
    ({"training": {"fp16": False, "bf16": True}}, {"model.dtype": "bf16"}),
    ({"training": {"fp16": True}}, {"model.dtype": "fp16"}),
    ({"fp16": False}, {"model.dtype": "fp32"}),
    ({"bf16": True, "training": {"fp16": False}}, {"model.dtype": "bf16"}),  # read together across places
    ({"training": {"mixed_precision": "fp16"}}, {"model.dtype": "fp16"}),
    ({"mixed_precision": "no"}, {"model.dtype": "fp32"}),
    ({"training": {"use_mixed_precision": True}}, {"model.dtype": "auto"}),
    ({"use_mixed_precision": False}, {"model.dtype": "fp32"}),
    ({"training": {"fp16_opt_level": "O1", "fp16_full_eval": False}}, {"model.dtype": "auto"}),
    ({"use_lora": True, "lora": {"r": 16, "alpha": 32, "dropout": 0.1}},
     {"model.lora.r": 16, "model.lora.alpha": 32.0, "model.lora.dropout": 0.1}),
    ({"use_lora": True}, {"model.lora.r": 16}),
    ({"use_lora": False, "lora": {"r": 8}}, {"model.lora": None}),
    ({"lora": None}, {"model.lora": None}),
    ({"training": {"lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}}},
     {"model.lora.r": 4, "model.lora.alpha": 8.0, "model.lora.dropout": 0.0}),
    ({"max_length": 1024}, {"data.max_length": 1024}),
    ({"training": {"max_seq_length": 256}}, {"data.max_length": 256}),
    ({"dataloader_num_workers": 4}, {"data.num_workers": 4}),
    ({"training": {"dataloader_num_workers": 2, "dataloader_pin_memory": True, "dataloader_drop_last": True,
                   "dataloader_prefetch_factor": 2}}, {"data.num_workers": 2}),
    ({"training": {"output_dir": "out/x"}}, {"output_dir": "out/x"}),
    ({"save_steps": 500, "save_total_limit": 3}, {"checkpoint.save_steps": 500, "checkpoint.save_total_limit": 3}),
    ({"training": {"save_strategy": "steps", "save_steps": 1000}}, {"checkpoint.save_steps": 1000}),
    ({"save_strategy": "steps"}, {"checkpoint.save_steps": 500}),
    ({"save_strategy": "no"}, {"checkpoint.save_steps": None}),
    ({"resume_from_checkpoint": True}, {"checkpoint.resume_from": "latest"}),
    ({"training": {"resume_from_checkpoint": False}}, {"checkpoint.resume_from": None}),
    ({"logging_steps": 50}, {"logging.logging_steps": 50}),
    ({"training": {"report_to": ["tensorboard", "wandb"]}},
     {"logging.report_to": ["console", "jsonl", "tensorboard", "wandb"]}),
    ({"report_to": "none"}, {"logging.report_to": ["console", "jsonl"]}),
    ({"run_name": "r1"}, {"logging.run_name": "r1"}),
    ({"training": {"experiment_name": "sft_4gpu"}}, {"logging.run_name": "sft_4gpu", "output_dir": "runs/sft_4gpu"}),
    ({"experiment_name": "e", "output_dir": "elsewhere"}, {"logging.run_name": "e", "output_dir": "elsewhere"}),
    ({"logging_dir": "logs/x"}, {"output_dir": "runs/alignkit"}),
    ({"push_to_hub": True, "hub_model_id": "me/tiny", "hub_private_repo": True},
     {"hub.push_to_hub": True, "hub.repo_id": "me/tiny", "hub.private": True}),
    ({"deepspeed": "ds.json"}, {"distributed.strategy": "deepspeed", "distributed.deepspeed.config_path": "ds.json"}),
    ({"training": {"distributed_strategy": "deepspeed", "deepspeed": {"config_path": "configs/deepspeed/zero2.json"}}},
     {"distributed.strategy": "deepspeed", "distributed.deepspeed.config_path": "configs/deepspeed/zero2.json"}),
    ({"distributed_strategy": "fsdp"}, {"distributed.strategy": "fsdp"}),
    ({"training": {"use_ddp": True}}, {"distributed.strategy": "ddp"}),
    ({"use_ddp": False}, {"distributed.strategy": "single"}),
    ({"training": {"distributed": True}}, {"distributed.strategy": "auto"}),
    ({"training": {"distributed": False}}, {"distributed.strategy": "single"}),
    ({"training": {"distributed_backend": "gloo"}}, {"distributed.backend": "gloo"}),
    ({"ddp_backend": "nccl"}, {"distributed.backend": "nccl"}),
    ({"ddp_timeout": 1800}, {"distributed.timeout_minutes": 30.0}),
    ({"training": {"find_unused_parameters": True, "ddp_bucket_cap_mb": 50, "ddp_broadcast_buffers": True}},
     {"distributed.ddp.find_unused_parameters": True, "distributed.ddp.bucket_cap_mb": 50.0,
      "distributed.ddp.broadcast_buffers": True}),
    ({"ddp_find_unused_parameters": True}, {"distributed.ddp.find_unused_parameters": True}),
    # alignkit's own keys that moved: reward-model training left the online scoring section
    ({"reward": {"pair": "safety", "reg_coeff": 0.001}}, {"reward_model.pair": "safety", "reward_model.reg_coeff": 0.001}),
    ({"reward": {"margin": 0.5, "center_coeff": 0.01, "length_penalty": 0.1}},  # online scoring keys stay
     {"reward_model.margin": 0.5, "reward_model.center_coeff": 0.01, "reward.length_penalty": 0.1}),
]


def _places(name: str) -> set[str]:
    """Where ``name`` is read the same way (``batch_size`` means one thing at the top, another in training:)."""
    entries = [a for a in ALIASES if name in a.names]
    return set(entries[0].places) if len(entries) == 1 else set()


def _mirrored(cases: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each case, plus the same aliases written at their other place (top level <-> inside training:)."""
    out = list(cases)
    for given, expected in cases:
        top = {k: v for k, v in given.items() if k != "training" and _places(k)}
        inner = given.get("training", {})
        rest = {k: v for k, v in given.items() if k != "training" and k not in top}
        if top and not inner and all(TRAINING in _places(k) for k in top):
            out.append(({**rest, "training": top}, expected))
        if inner and not top and all(TOP in _places(k) for k in inner):
            out.append(({**rest, **inner}, expected))
    return out


CASES = _mirrored(CASES)


@pytest.mark.parametrize(("given", "expected"), CASES, ids=[str(given) for given, _ in CASES])
def test_alias_maps_to_its_native_key(given: dict[str, Any], expected: dict[str, Any]) -> None:
    cfg, notes = native({**copy.deepcopy(REQUIRED), **given})
    for key, want in expected.items():
        assert value(cfg, key) == want, key
    read = [k for k in given if k not in REQUIRED] + [k for k in given.get("training", {})]
    assert notes and all(n.startswith("config: ") and "\n" not in n for n in notes)
    # one note per alias (keys read together, like bf16 + fp16 or use_lora + lora, share one)
    assert len(notes) <= len(read)


def test_every_alias_has_a_case() -> None:
    seen = {(TRAINING, k) for given, _ in CASES for k in given.get("training", {})}
    seen |= {(TOP, k) for given, _ in CASES for k in given if k != "training"}
    seen |= {(REWARD, k) for given, _ in CASES for k in given.get(REWARD, {})}
    missing = [(p, n) for a in ALIASES for p in a.places for n in a.names if (p, n) not in seen]
    assert not missing, missing


def test_no_alias_shadows_a_native_key() -> None:
    import dataclasses

    top = {f.name for f in dataclasses.fields(RunConfig)}
    for a in ALIASES:
        for place in a.places:
            native_keys = top if place == TOP else {f.name for f in dataclasses.fields(value(RunConfig(), place))}
            assert not set(a.names) & native_keys, (place, a.names)


def test_note_says_how_the_alias_was_read() -> None:
    _, notes = native({**REQUIRED, "per_device_train_batch_size": 4, "training": {"batch_size": 32}})
    assert notes[0] == "config: per_device_train_batch_size=4 read as training.per_device_batch_size=4"
    assert notes[1] == ("config: training.batch_size=32 read as training.global_batch_size=32 "
                        "(the global batch per optimizer step, split across processes)")
    _, notes = native({**REQUIRED, "dataloader_pin_memory": True})
    assert notes == ["config: dataloader_pin_memory=true accepted and ignored (alignkit's DataLoader does not pin "
                     "host memory; batches move to the device per micro-batch)"]


@pytest.mark.parametrize(
    ("given", "pattern"),
    [
        ({"per_device_train_batch_size": 4, "training": {"per_device_batch_size": 8}},
         r"^per_device_train_batch_size=4 \(read as training.per_device_batch_size=4\) disagrees with "
         r"training.per_device_batch_size=8; give only training.per_device_batch_size$"),
        ({"batch_size": 4, "per_device_train_batch_size": 8},
         r"^batch_size=4 \(read as training.per_device_batch_size=4\) disagrees with per_device_train_batch_size=8 "
         r"\(read as training.per_device_batch_size=8\)"),
        ({"bf16": True, "model": {"name_or_path": "m", "dtype": "fp16"}}, r"^bf16=true \(read as model.dtype=bf16\) "
         r"disagrees with model.dtype=fp16"),
        ({"deepspeed": "ds.json", "distributed": {"strategy": "ddp"}}, r"disagrees with distributed.strategy=ddp"),
        ({"save_strategy": "epoch"}, r"^save_strategy='epoch' cannot be honoured: .*save_steps"),
        ({"lr_scheduler_type": "polynomial"}, r"^lr_scheduler_type='polynomial' has no alignkit equivalent"),
        ({"bf16": True, "fp16": True}, r"bf16=true and fp16=true: pick one"),
        ({"report_to": ["mlflow"]}, r"report_to: 'mlflow' is not supported"),
        ({"deepspeed": {"zero_optimization": {"stage": 2}}}, r"inline DeepSpeed config is not read"),
        ({"lora": {"rank": 8}}, r"lora.rank: unknown"),
        ({"training": {"dataloader": {"shuffle": True}}}, r"dataloader.shuffle: unknown"),
        ({"save_strategy": "no", "save_steps": 100}, r"disagrees with save_steps=100"),
        ({"seed": 1, "training": {"accumulation_steps": 2}, "accumulation_steps": 4},
         r"^accumulation_steps=4 and training.accumulation_steps=2 disagree; give one$"),
        ({"reward": {"pair": "safety"}, "reward_model": {"pair": "helpful"}},
         r"^reward.pair=safety \(read as reward_model.pair=safety\) disagrees with reward_model.pair=helpful; "
         r"give only reward_model.pair$"),
    ],
)
def test_bad_or_conflicting_alias_is_a_one_line_error(given: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as e:
        native({**copy.deepcopy(REQUIRED), **given})
    assert "\n" not in str(e.value)


def test_overrides_may_be_aliases_and_win_over_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.yaml", {**REQUIRED, "per_device_train_batch_size": 4, "output_dir": "o",
                                              "training": {"learning_rate": 1e-4}})
    cfg = load_config(path, ["training.per_device_batch_size=2", "learning_rate=3e-4", "experiment_name=e"])
    assert cfg.training.per_device_batch_size == 2 and cfg.training.learning_rate == 3e-4
    assert cfg.logging.run_name == "e" and cfg.output_dir == "o"  # the file gives output_dir
    with pytest.raises(ConfigError, match="disagrees"):  # two overrides that disagree
        load_config(path, ["per_device_train_batch_size=2", "training.per_device_batch_size=3"])
    cfg = load_config(path, ["model.lora={r: 4}", "bf16=true", "fp16=false"])
    assert cfg.model.lora is not None and cfg.model.lora.r == 4 and cfg.model.dtype == "bf16"


def test_notes_come_from_rank_zero_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from alignkit.config import aliases

    said: list[str] = []
    monkeypatch.setattr(aliases.log, "warning", lambda msg, *a: said.append(msg))
    path = write_config(tmp_path / "c.yaml", {**REQUIRED, "per_device_train_batch_size": 4})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    load_config(path)
    assert said == []
    monkeypatch.setenv("RANK", "0")
    load_config(path)
    assert said == ["config: per_device_train_batch_size=4 read as training.per_device_batch_size=4"]
    load_config(path, notes=False)
    assert len(said) == 1


def test_reward_model_keys_under_reward_still_read_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config written before reward_model: existed trains the same model; rank 0 says where the keys went,
    an override may use the old name, and ``alignkit migrate`` writes the new one."""
    from alignkit.algorithms.reward import RewardConfig, RewardModelConfig
    from alignkit.cli import main
    from alignkit.config import aliases

    said: list[str] = []
    monkeypatch.setattr(aliases.log, "warning", lambda msg, *a: said.append(msg))
    old = {**REQUIRED, "algorithm": "cost_model", "training": {"per_device_batch_size": 2},
           "reward": {"pair": "safety", "reg_coeff": 0.001}}
    path = write_config(tmp_path / "rm.yaml", old)
    cfg = load_config(path)
    assert cfg.section(RewardModelConfig) == RewardModelConfig(pair="safety", reg_coeff=0.001)
    assert cfg.section(RewardConfig) == RewardConfig()
    assert said == ["config: reward.pair=safety, reward.reg_coeff=0.001 read as reward_model.pair=safety, "
                    "reward_model.reg_coeff=0.001 (reward-model training keys moved to reward_model:; "
                    "reward: is online scoring)"]
    assert load_config(path, ["reward.reg_coeff=0.01"]).section(RewardModelConfig).reg_coeff == 0.01
    out = tmp_path / "runs" / "native.yaml"  # as docs/config-keys.md writes it: the folder made on the way
    assert main(["migrate", str(path), "--out", str(out)]) == 0
    new = {**old, "reward_model": {"pair": "safety", "reg_coeff": 0.001}}
    del new["reward"]
    assert yaml.safe_load(out.read_text()) == new


# ---------------------------------------------------------------- migrate

SEED_STYLE = {  # the seed guides' shapes: flat HF keys under training:, top-level LoRA and batch_size
    "algorithm": "dpo",
    "model_name_or_path": "some/model",
    "data": {"train": "builtin:pref_train.jsonl"},
    "use_lora": True,
    "lora": {"r": 16, "alpha": 32, "dropout": 0.1},
    "batch_size": 4,
    "max_length": 512,
    "learning_rate": 5e-7,
    "training": {
        "distributed": True, "distributed_strategy": "ddp", "find_unused_parameters": False, "ddp_bucket_cap_mb": 25,
        "gradient_accumulation_steps": 2, "fp16": False, "bf16": True, "gradient_checkpointing": True,
        "dataloader_num_workers": 4, "dataloader_pin_memory": True, "dataloader_drop_last": True,
        "experiment_name": "sft_4gpu_experiment", "save_steps": 500, "save_total_limit": 3, "logging_steps": 50,
        "report_to": ["tensorboard"], "save_strategy": "steps", "warmup_ratio": 0.1, "lr_scheduler_type": "cosine",
    },
}


@pytest.mark.parametrize("given", [SEED_STYLE, *[{**REQUIRED, **g} for g, _ in CASES[:12]]])
def test_migrate_output_loads_to_the_same_run_config(given: dict[str, Any], tmp_path: Path) -> None:
    from alignkit.cli import main

    src = write_config(tmp_path / "seed.yaml", given)
    out = tmp_path / "native.yaml"
    assert main(["migrate", str(src), "--out", str(out)]) == 0
    migrated = yaml.safe_load(out.read_text())
    t = native(given)[0].training
    fill = ["training.per_device_batch_size=1"] if t.per_device_batch_size is t.global_batch_size is None else []
    assert load_config(out, fill) == load_config(src, fill)
    again, notes = migrate_raw(migrated)
    assert again == migrated and notes == []  # migrating a native config changes nothing


@pytest.mark.parametrize("name", ["sft", "dpo", "dpo_lora", "rm_helpful", "rm_harmless"])
def test_migrating_a_native_config_is_the_identity(name: str, capsys: pytest.CaptureFixture) -> None:
    from alignkit.cli import main

    path = REPO / "configs" / f"{name}.yaml"
    assert main(["migrate", str(path)]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out) == yaml.safe_load(path.read_text())
    assert "uses alignkit's own keys already" in captured.err


def test_algorithm_flag_is_the_algorithm_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import alignkit.cli.run_commands as runner  # the command's module: run_train and load_config as it calls them
    from alignkit.cli import main

    seen: list[RunConfig] = []
    monkeypatch.setattr(runner, "run_train", seen.append)
    path = write_config(tmp_path / "c.yaml", {**REQUIRED, "per_device_train_batch_size": 1})
    assert main(["train", str(path), "--algorithm", "dpo", "training.learning_rate=1e-6"]) == 0
    assert seen[0].algorithm == "dpo" and seen[0].training.learning_rate == 1e-6
