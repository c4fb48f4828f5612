"""Config loading: types, ranges, unknown keys with suggestions, batch arithmetic, LR scaling."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from alignkit.config import ConfigError, load_config, resolve_batch, scaled_learning_rate
from alignkit.config.loader import apply_overrides, build_dataclass
from alignkit.config.schema import RunConfig, f
from tests.conftest import REPO, run_cli, write_config

BASE = {
    "algorithm": "sft",
    "model": {"name_or_path": "some/model"},
    "data": {"train": "builtin:sft_train.jsonl"},
    "training": {"per_device_batch_size": 4},
}


def cfg_from(raw: dict, overrides: list[str] | None = None) -> RunConfig:
    import copy

    from alignkit.config.loader import validate

    cfg = build_dataclass(RunConfig, apply_overrides(copy.deepcopy(raw), overrides or []))
    validate(cfg)
    return cfg


def test_defaults_and_overrides() -> None:
    cfg = cfg_from(BASE, ["training.learning_rate=3e-4", "data.max_length=64", "logging.report_to=[jsonl]"])
    assert cfg.training.learning_rate == 3e-4
    assert cfg.data.max_length == 64
    assert cfg.data.train == ["builtin:sft_train.jsonl"]  # a single string becomes a list
    assert cfg.logging.report_to == ["jsonl"]
    assert cfg.distributed.strategy == "auto"


def test_algorithm_sections_read_typed_through_section() -> None:
    from dataclasses import dataclass

    from alignkit.algorithms.dpo import DPOConfig
    from alignkit.rollout.config import RolloutConfig

    cfg = cfg_from({**BASE, "algorithm": "dpo", "dpo": {"beta": 0.25}})
    d = cfg.section(DPOConfig)
    assert isinstance(d, DPOConfig) and d.beta == 0.25
    assert cfg.dpo is d  # the attribute form (scripts, tests) is the same object
    assert cfg.section(RolloutConfig) == RolloutConfig()  # absent from the YAML: its defaults
    assert RunConfig().section(DPOConfig) == DPOConfig()

    @dataclass
    class Unregistered:
        x: int = 0

    with pytest.raises(KeyError, match="Unregistered is not a registered config section"):
        cfg.section(Unregistered)


def test_unknown_key_names_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'training.learning_rat'.*'training.learning_rate'"):
        cfg_from(BASE, ["training.learning_rat=1e-4"])
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'.*'model'"):
        cfg_from({**BASE, "modle": {}})


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("training.per_device_batch_size=two", r"training.per_device_batch_size: expected an integer.*'two'"),
        ("training.per_device_batch_size=0", r"training.per_device_batch_size: must be > 0"),
        ("model.dtype=fp8", r"model.dtype: expected one of 'auto', 'bf16', 'fp16', 'fp32', got 'fp8'"),
        ("model.gradient_checkpointing=maybe", r"model.gradient_checkpointing: expected true/false"),
        ("training.warmup_ratio=1.5", r"training.warmup_ratio: must be <= 1"),
        ("distributed.strategy=dpp", r"did you mean 'ddp'"),
        ("training.lr_scaling=linear", r"training.reference_batch_size: required"),
        ("logging.report_to=[console, mlflow]", r"unknown sink"),
        ("algorithm=sftt", r"algorithm: unknown 'sftt' \(did you mean 'sft'\?\)"),
    ],
)
def test_bad_values_are_named(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        cfg_from(BASE, [override])


def test_null_on_an_optional_list_is_none() -> None:
    """`data.eval=null` (issue 42.4) was refused ("expected a list of a string"); a list whose default is empty
    takes null as none, a list with a default of its own still wants a list, and the line names the inner key."""
    assert cfg_from(BASE, ["data.eval=null"]).data.eval == []
    assert cfg_from({**BASE, "data": {**BASE["data"], "eval": None}}).data.eval == []
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules: expected a list of strings, got None$"):
        cfg_from(BASE, ["model.lora.r=8", "model.lora.target_modules=null"])
    with pytest.raises(ConfigError, match=r"^data.train: required"):
        cfg_from(BASE, ["data.train=null"])


def test_batch_arithmetic() -> None:
    cfg = cfg_from(BASE, ["training.gradient_accumulation_steps=2"])
    plan = resolve_batch(cfg, 2)
    assert (plan.per_device, plan.accumulation, plan.world_size, plan.global_batch) == (4, 2, 2, 16)
    g = cfg_from({**BASE, "training": {"global_batch_size": 16, "gradient_accumulation_steps": 2}})
    assert resolve_batch(g, 2).per_device == 4
    assert resolve_batch(g, 1).per_device == 8
    with pytest.raises(ConfigError, match=r"global_batch_size=16 is not divisible by gradient_accumulation_steps=2 x world_size=3"):
        resolve_batch(g, 3)
    both = cfg_from({**BASE, "training": {"global_batch_size": 16, "per_device_batch_size": 3}})
    with pytest.raises(ConfigError, match="disagrees"):
        resolve_batch(both, 1)
    with pytest.raises(ConfigError, match="give training.per_device_batch_size or training.global_batch_size"):
        cfg_from({**BASE, "training": {}})


def test_lr_scaling_rules() -> None:
    lin = cfg_from(BASE, ["training.lr_scaling=linear", "training.reference_batch_size=4", "training.learning_rate=1e-4"])
    assert scaled_learning_rate(lin, resolve_batch(lin, 4)) == pytest.approx(4e-4)
    sq = cfg_from(BASE, ["training.lr_scaling=sqrt", "training.reference_batch_size=4", "training.learning_rate=1e-4"])
    assert scaled_learning_rate(sq, resolve_batch(sq, 4)) == pytest.approx(2e-4)


def test_yaml_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line \d+: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_a_recipe_path_outside_the_clone_reads_the_shipped_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The docs' blocks say ``alignkit train configs/X.yaml``: run from an empty folder (not the clone), a
    ``configs/NAME`` the folder lacks is the repository's shipped recipe, said in one line (rank 0's config note);
    a local file wins; a name not shipped is still the one-line error."""
    from alignkit.config.loader import read_yaml

    monkeypatch.chdir(tmp_path)
    assert read_yaml("configs/sft_digits.yaml") == read_yaml(REPO / "configs" / "sft_digits.yaml")
    assert "reading the shipped recipe" in caplog.text
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "sft_digits.yaml").write_text("algorithm: dpo\n")
    assert read_yaml("configs/sft_digits.yaml") == {"algorithm": "dpo"}
    with pytest.raises(ConfigError, match=r"config file 'configs/no_such_recipe.yaml' does not exist$"):
        read_yaml("configs/no_such_recipe.yaml")


@pytest.mark.parametrize(("given", "meant"), [("grpo", "grpo.yaml"), ("configs/grpoo.yaml", "grpo.yaml"),
                                              ("sft_digit", "sft_digits.yaml"), ("dpo.yml", "dpo.yaml")])
def test_a_missing_config_names_the_closest_shipped_recipe(given: str, meant: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A newcomer types a recipe's name (``alignkit train grpo``) or misspells one: the one-line error says which
    shipped recipe was likely meant; a name near none says only that the file does not exist."""
    from alignkit.config.loader import read_yaml

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"'{given}' does not exist \(did you mean configs/{meant}, a shipped"):
        read_yaml(given)
    with pytest.raises(ConfigError, match=r"'my_own_run.yaml' does not exist$"):
        read_yaml("my_own_run.yaml")


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("training.lerning_rate=1", "unknown config key 'training.lerning_rate'"),
        ("training.max_steps=-3", "training.max_steps: must be > 0"),
        ("training.global_batch_size=10", "not divisible"),
    ],
)
def test_cli_one_line_errors(tmp_path: Path, micro_model: Path, override: str, pattern: str) -> None:
    cfg = write_config(tmp_path / "c.yaml", {**BASE, "model": {"name_or_path": str(micro_model)},
                                              "training": {"gradient_accumulation_steps": 4}})
    extra = [] if "global" in override else ["training.per_device_batch_size=2"]
    proc = run_cli(["validate", str(cfg), override, *extra, "--world-size", "1"])
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("alignkit: error:"), proc.stderr
    assert pattern in lines[0]


def test_validate_prints_plan(tmp_path: Path, micro_model: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", {**BASE, "model": {"name_or_path": str(micro_model)},
                                              "data": {"train": "builtin:sft_train.jsonl", "max_train_examples": 100},
                                              "training": {"per_device_batch_size": 4, "gradient_accumulation_steps": 2}})
    proc = run_cli(["validate", str(cfg), "--world-size", "2"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "effective batch" in out and "16 (per_device=4 x accumulation=2 x 2 processes)" in out
    # 100 examples / 2 ranks = 50 per rank -> 13 micro-batches of 4 -> 7 optimizer steps
    assert "optimizer steps per epoch" in out and out.rstrip().endswith("7")


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_loads_in_native_keys(name: str) -> None:
    """Every recipe in configs/ loads (types, ranges, sections) and says nothing about keys read from
    elsewhere: the shipped files show the keys users should write (reward_model:, not reward.pair)."""
    from alignkit.config.loader import native_raw

    path = REPO / "configs" / name
    _, notes = native_raw(path)
    assert notes == [], notes
    assert load_config(path, notes=False).algorithm


@dataclass
class Section:
    args: dict[str, Any] = f({}, "free settings")
    weights: dict[str, float] = f({"a": 1.0}, "typed values")


def test_dict_fields_load_typed_with_errors_naming_the_key() -> None:
    """A ``dict[str, X]`` field (``agent.env_args``) reads a YAML mapping, null as {}, each value converted to X
    (``Any``: as YAML read it); anything else is one line naming the key (issue 48, B)."""
    s = build_dataclass(Section, {"args": {"tool": "calc", "digits": 2, "nested": {"k": [1, 2]}}, "weights": None})
    assert s.args == {"tool": "calc", "digits": 2, "nested": {"k": [1, 2]}} and s.weights == {}
    assert build_dataclass(Section, {"weights": {"b": "1e-3", "c": 2}}).weights == {"b": 1e-3, "c": 2.0}
    assert build_dataclass(Section, {}).weights == {"a": 1.0} and Section().args is not Section().args
    with pytest.raises(ConfigError, match=r"^sec\.args: expected a mapping \(key: value, e\.g\. \{digits: 2\}\), got "
                                          r"\['calc'\]$"):
        build_dataclass(Section, {"args": ["calc"]}, "sec")
    with pytest.raises(ConfigError, match=r"^sec\.weights\.b: expected a number, got 'x'$"):
        build_dataclass(Section, {"weights": {"b": "x"}}, "sec")


def test_dict_field_from_yaml_and_override(tmp_path: Path) -> None:
    raw = {**BASE, "algorithm": "grpo_agent", "agent": {"env_args": {"tool": "calc"}}}
    cfg = load_config(write_config(tmp_path / "c.yaml", raw), ["agent.env_args.tool=calculator"], notes=False)
    assert cfg.agent.env_args == {"tool": "calculator"}
    cfg = load_config(write_config(tmp_path / "c.yaml", raw), ["agent.env_args={tool: calc, extra: 1}"], notes=False)
    assert cfg.agent.env_args == {"tool": "calc", "extra": 1}
    with pytest.raises(ConfigError, match=r"^agent\.env_args: expected a mapping .*got 'calc'$"):
        load_config(write_config(tmp_path / "c.yaml", raw), ["agent.env_args=calc"], notes=False)


@pytest.mark.parametrize(("extra", "message"), [
    (["model.freeze=['(']"], r"model\.freeze: '\(' is not a regular expression \(missing \), unterminated"),
    (["model.freeze=[embed_tokens]", "model.lora={r: 4}"], r"model\.freeze: not with model\.lora"),
])
def test_a_freeze_that_cannot_apply_is_refused_at_load(extra: list[str], message: str) -> None:
    """``model.freeze`` beside LoRA, or not a regular expression, is one line when the config is read (``alignkit
    validate`` too), not only once the model is loaded; a valid list passes (a pattern matching no parameter
    needs the model: tests/integration/test_freeze.py)."""
    sft = REPO / "configs" / "sft.yaml"
    with pytest.raises(ConfigError, match=message):
        load_config(sft, extra, notes=False)
    assert load_config(sft, ["model.freeze=[embed_tokens, 'layers\\.0\\.']"], notes=False).model.freeze == [
        "embed_tokens", "layers\\.0\\."]
