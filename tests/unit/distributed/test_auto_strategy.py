"""``distributed.strategy: auto`` from the memory estimate, the config -> MemoryInputs mapping, and
``alignkit estimate`` on the seed scenario (7B policy + reference + two 7B reward models, 8 x 64 GB)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from alignkit.algorithms import workload_of
from alignkit.config import ConfigError, load_config
from alignkit.distributed.env import DistEnv
from alignkit.distributed.strategy import resolve_strategy as _resolve_strategy
from alignkit.models.roles import ModelSpec, Workload
from alignkit.planner import auto
from alignkit.planner.auto import DeviceMemory
from alignkit.planner.auto import memory_inputs as _memory_inputs
from alignkit.planner.model_dims import PRESETS
from alignkit.planner.plan import GB, estimate
from alignkit.train.runner import strategy_for
from tests.conftest import REPO, assert_ok, run_cli

LLAMA7B = PRESETS["llama-7b"]


def memory_inputs(cfg, **kw):
    """The planner's inputs for ``cfg``'s algorithm, from the model specs it declares."""
    return _memory_inputs(cfg, workload_of(cfg), **kw)


def resolve_strategy(cfg, env, memory=None):
    return _resolve_strategy(cfg, env, workload_of(cfg), memory)


def resolve_strategy_name(cfg, env, memory=None):
    return resolve_strategy(cfg, env, memory)[:2]


def build_strategy(cfg, env):
    return strategy_for(cfg, env)


def _env(world: int, local: int | None = None) -> DistEnv:
    return DistEnv(rank=0, world_size=world, local_rank=0, local_world_size=local or world,
                   master_addr=None, master_port=None)


@pytest.fixture(scope="module")
def llama7b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config.json with Llama-2-7B's shape (no weights: the estimate reads the config only)."""
    out = tmp_path_factory.mktemp("llama7b")
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                vocab_size=32000).save_pretrained(out)
    return out


def _sft(model: Path, *extra: str):
    return load_config(None, ["algorithm=sft", f"model.name_or_path={model}", "model.dtype=bf16",
                              "model.gradient_checkpointing=true", "data.train=[builtin:sft_train.jsonl]",
                              "data.max_length=512", "training.per_device_batch_size=1", *extra])


# --------------------------------------------------------------------------- the decision
@pytest.mark.parametrize("gb,deepspeed,want", [
    (400, True, ("ddp", None)),
    (80, True, ("deepspeed", 2)),
    (80, False, ("fsdp", False)),
    (24, True, ("deepspeed", 3)),
    (24, False, ("fsdp", True)),
])
def test_auto_picks_from_fake_gpu_memory(llama7b_dir: Path, monkeypatch: pytest.MonkeyPatch, gb: int,
                                         deepspeed: bool, want: tuple) -> None:
    """Full 7B on 8 GPUs: ddp needs ~136 GB, ZeRO-2 ~30 GB, ZeRO-3 ~17 GB per GPU."""
    real = importlib.util.find_spec
    monkeypatch.setattr(auto.importlib.util, "find_spec",
                        lambda name, *a: (real(name, *a) if deepspeed else None) if name == "deepspeed" else real(name, *a))
    cfg = _sft(llama7b_dir)
    name, why, dist = resolve_strategy(cfg, _env(8), DeviceMemory("cuda", gb * GB, f"{gb} GB per GPU"))
    assert (name, dist.deepspeed.zero_stage if name == "deepspeed" else
            dist.fsdp.reshard_after_forward if name == "fsdp" else None) == want, why
    assert why.startswith(f"auto: 8 processes, {gb} GB per GPU; ")
    if name != "ddp":
        assert "ddp needs" in why and "> " in why  # says what did not fit
    assert cfg.distributed.strategy == "auto" and cfg.distributed.deepspeed.zero_stage is None  # untouched


def test_auto_on_cpu_is_ddp_unless_ram_is_short(llama7b_dir: Path, tmp_path: Path) -> None:
    cfg = _sft(llama7b_dir)
    name, why = resolve_strategy_name(cfg, _env(2), DeviceMemory("cpu", 300 * GB, "600 GB host RAM / 2"))
    assert name == "ddp" and "GB/process" in why
    name, why, dist = resolve_strategy(cfg, _env(2), DeviceMemory("cpu", 100 * GB, "200 GB host RAM / 2"))
    assert name == "fsdp" and "deepspeed" not in why  # never DeepSpeed on CPU
    assert "ddp needs" in why


def test_auto_single_process_and_explicit(llama7b_dir: Path) -> None:
    assert resolve_strategy_name(_sft(llama7b_dir), _env(1)) == ("single", "auto: one process")
    tiny = DeviceMemory("cuda", 1, "1 byte")
    assert resolve_strategy_name(_sft(llama7b_dir, "distributed.strategy=ddp"), _env(8), tiny) == (
        "ddp", "set in the config")


def test_auto_without_estimate_falls_back_to_ddp(tmp_path: Path) -> None:
    cfg = _sft(tmp_path / "no-such-model")
    name, why = resolve_strategy_name(cfg, _env(2), DeviceMemory("cuda", 80 * GB, "80 GB"))
    assert name == "ddp" and "no memory estimate" in why


def test_build_strategy_uses_the_resolved_settings(llama7b_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "probe_device_memory", lambda env: DeviceMemory("cpu", 20 * GB, "fake"))
    strategy = build_strategy(_sft(llama7b_dir), _env(2))
    assert strategy.name == "fsdp" and strategy.cfg.fsdp.reshard_after_forward is True


# --------------------------------------------------------------------------- config -> inputs
def test_memory_inputs_follow_the_config(llama7b_dir: Path) -> None:
    dpo = load_config(REPO / "configs" / "dpo.yaml", [f"model.name_or_path={llama7b_dir}", "data.max_length=512",
                                                      "training.per_device_batch_size=4"])
    inp = memory_inputs(dpo, n_gpus=8)
    assert inp.policy == LLAMA7B and inp.reference == "model" and inp.sequences_per_example == 2
    assert (inp.param_dtype, inp.master_weights_fp32, inp.optimizer_impl) == ("bf16", True, "auto")
    assert inp.tokens == 4 * 2 * 512 and inp.lora_r is None
    assert memory_inputs(dpo, n_gpus=2, device="cpu").param_dtype == "fp32"  # auto dtype on CPU

    lora = load_config(REPO / "configs" / "dpo_lora.yaml", [f"model.name_or_path={llama7b_dir}"])
    inp = memory_inputs(lora, n_gpus=8)
    assert inp.lora_r == 16 and inp.lora_targets == ("q", "k", "v", "o", "gate", "up", "down")
    assert inp.reference == "precomputed"  # dpo_lora.yaml precomputes the lora_base log-probs
    inp = memory_inputs(load_config(REPO / "configs" / "dpo_lora.yaml", [
        f"model.name_or_path={llama7b_dir}", "dpo.precompute_ref_logps=false"]), n_gpus=8)
    assert inp.reference == "lora_base"

    rm = load_config(REPO / "configs" / "rm_helpful.yaml", [f"model.name_or_path={llama7b_dir}"])
    inp = memory_inputs(rm, n_gpus=8, frozen=["llama-7b"])
    assert inp.policy == LLAMA7B.as_score_model() and inp.reference == "none"
    assert inp.frozen_models == (LLAMA7B.as_score_model(),)


def test_planner_sizes_a_four_model_run_from_specs_alone(llama7b_dir: Path) -> None:
    """Safe-DPO's shape (policy + reference + reward + cost) planned from ModelSpecs, no algorithm named."""
    cfg = _sft(llama7b_dir, "training.per_device_batch_size=4")
    src = str(llama7b_dir)
    four = Workload((ModelSpec("policy", src, "lm", trainable=True), ModelSpec("reference", src, "lm"),
                     ModelSpec("reward", src, "scalar"), ModelSpec("cost", src, "scalar")), sequences_per_example=2)
    inp = _memory_inputs(cfg, four, n_gpus=8)
    assert inp.policy == LLAMA7B and inp.reference == "model" and inp.sequences_per_example == 2
    assert inp.frozen_models == (LLAMA7B.as_score_model(), LLAMA7B.as_score_model())
    assert inp.tokens == 4 * 2 * 512
    full = estimate(inp, "ddp")
    assert full.gpu["reference model"] == LLAMA7B.n_params * 2  # bf16
    assert full.gpu["frozen models"] == 2 * LLAMA7B.as_score_model().n_params * 2
    # the same planner sizes an actor + critic (two trainable roles) and a transient reference
    ac = Workload((ModelSpec("policy", src, "lm", trainable=True), ModelSpec("value", src, "scalar", trainable=True),
                   ModelSpec("reference", src, "lm", transient=True)))
    inp2 = _memory_inputs(cfg, ac, n_gpus=8)
    assert inp2.reference == "precomputed" and inp2.extra_trainable == (LLAMA7B.as_score_model(),)
    critic = LLAMA7B.as_score_model().n_params
    assert estimate(inp2, "ddp").gpu["other trainable models"] == critic * (2 + 4 + 2 + 8)
    assert estimate(inp2, "zero3").gpu["other trainable models"] < critic * 16 / 7
    assert auto.frozen_roles(four) == ["reference", "reward", "cost"]


# --------------------------------------------------------------------------- the CLI, seed scenario
# LM-head chunks of 1024 rows (the seed era's size): the GPU byte budget's larger chunks add ~0.9 GB of head transients
SEED_OVERRIDES = ["model.dtype=bf16", "model.gradient_checkpointing=true", "training.per_device_batch_size=4",
                  "data.max_length=512", "dpo.reference=model", "dpo.logps_chunk_size=1024"]
SEED = ["estimate", str(REPO / "configs" / "dpo.yaml"), "--preset", "llama-7b", "--frozen", "llama-7b",
        "--frozen", "llama-7b", "--gpus", "8", "--gpu-memory", "64GB", *SEED_OVERRIDES,
        "distributed.shard_frozen=false"]  # the seed's numbers: reference and RMs replicated everywhere


def _row(text: str, label: str) -> list[str]:
    return next(line for line in text.splitlines() if line.startswith(label)).split()[len(label.split()):]


def test_estimate_cli_seed_scenario_full_vs_lora() -> None:
    full = run_cli(SEED)
    assert_ok(full)
    print("\n" + full.stdout)
    header = _row(full.stdout, "component")
    assert header == ["ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp"]
    assert _row(full.stdout, "reference model") == ["13.5"] * 6
    assert _row(full.stdout, "frozen models") == ["26.4"] * 6  # two 6.61B reward models in bf16
    ddp_total = float(_row(full.stdout, "total")[0])
    assert ddp_total > 150  # the seed's "~103 GB, far above 64 GB", with fp32 Adam states and master weights
    assert "fits in 64.0 GB per GPU (57.6 GB usable): zero3_offload" in full.stdout

    lora = run_cli([*SEED, "model.lora={r: 16, dropout: 0.1}"])
    assert_ok(lora)
    print(lora.stdout)
    assert "LoRA r=16 q+k+v+o" in lora.stdout
    total = float(_row(lora.stdout, "total")[0])
    assert 55 <= total <= 66  # the seed: ~55-66 GB per GPU
    assert _row(lora.stdout, "fits (<= 57.6)")[0] == "yes"
    assert "would run ddp" in lora.stdout
    # the CLI's numbers are plan.estimate's on the mapped inputs
    cfg = load_config(REPO / "configs" / "dpo.yaml", SEED_OVERRIDES)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=""))  # as with --preset
    inputs = memory_inputs(cfg, n_gpus=8, policy=LLAMA7B, frozen=["llama-7b", "llama-7b"])
    assert f"{estimate(inputs, 'ddp').total / GB:.1f}" == f"{ddp_total:.1f}"


def test_estimate_with_shard_frozen_auto_counts_them_sharded_where_they_can_be() -> None:
    """Default ``distributed.shard_frozen: auto``: ZeRO-3 fits once the reference and RMs are sharded."""
    from alignkit.cli.estimate_command import estimate_command

    text = estimate_command(str(REPO / "configs" / "dpo.yaml"), SEED_OVERRIDES, gpus=8, gpu_memory="64GB",
                            preset="llama-7b", frozen=["llama-7b", "llama-7b"])
    assert _row(text, "reference model") == ["13.5", "13.5", "13.5", "1.7", "1.7", "1.7"]
    assert "fits in 64.0 GB per GPU (57.6 GB usable): zero3, zero3_offload, fsdp" in text
    assert ("frozen models counted sharded under zero3, zero3_offload, fsdp: distributed.shard_frozen=auto "
            "shards them only where replicated copies would not fit") in text
    assert "would run deepspeed zero_stage=3" in text or "would run fsdp" in text



def test_estimate_with_a_preset_never_reads_the_configs_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The preset stands for the policy: the config's model.name_or_path (here a directory that does not
    exist, which transformers would look up as a hub id, retrying for ~25 s when offline) is not read."""
    from transformers import AutoConfig

    from alignkit.cli.estimate_command import estimate_command

    asked: list[str] = []
    real = AutoConfig.from_pretrained

    def recording(source: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(str(source))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", recording)
    text = estimate_command(str(REPO / "configs" / "dpo.yaml"), ["model.name_or_path=runs/no-such-model"], gpus=8,
                            gpu_memory="80GB", preset="llama-7b")
    assert "would run" in text and asked == []

# --------------------------------------------------------------------------- frozen models: replicate or shard
def _dpo(model: Path, *extra: str):
    return load_config(REPO / "configs" / "dpo.yaml", [
        f"model.name_or_path={model}", "model.dtype=bf16", "model.gradient_checkpointing=true",
        "data.max_length=512", "training.per_device_batch_size=4", "dpo.reference=model", "dpo.logps_chunk_size=1024",
        *extra])


def _decide(cfg, monkeypatch: pytest.MonkeyPatch, gb: float | None, world: int = 8):
    """build_strategy + the frozen-model decision, with a fake device of ``gb`` GB (None: must not probe)."""
    def probe(env: DistEnv) -> DeviceMemory:
        assert gb is not None, "the device memory was probed where no estimate is needed"
        return DeviceMemory("cuda", int(gb * GB), f"{gb} GB per GPU")

    monkeypatch.setattr(auto, "probe_device_memory", probe)
    strategy = build_strategy(cfg, _env(world))
    workload = workload_of(cfg)
    strategy.decide_frozen_sharding(auto.frozen_roles(workload), lambda *a: auto.frozen_sharding(cfg, workload, *a))
    return strategy


@pytest.fixture
def frozen_log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What rank 0 logs about frozen models: the decision, once, with the first frozen model."""
    from alignkit.distributed.strategy import base

    lines: list[str] = []
    monkeypatch.setattr(base.log, "info", lambda msg, *a, **k: lines.append(msg))
    return lines


def _note(strategy) -> list[str]:
    return [strategy.frozen_note] if strategy.frozen_note else []


@pytest.mark.parametrize("gb,sharded", [(80, False), (24, True)])
def test_auto_shards_frozen_only_when_replicas_do_not_fit(
        llama7b_dir: Path, monkeypatch: pytest.MonkeyPatch, gb: int, sharded: bool) -> None:
    """7B policy + 7B reference under FSDP on 8 GPUs: ~33 GB/GPU with the reference replicated."""
    strategy = _decide(_dpo(llama7b_dir, "distributed.strategy=fsdp"), monkeypatch, gb)
    assert strategy.shard_frozen is sharded
    (line,) = _note(strategy)
    verdict = "sharded" if sharded else "replicated"
    assert line.startswith(f"Frozen models {verdict} (reference: 33.0 GB per rank with them replicated (13.5 GB) ")
    assert (f"> 0.9 x {gb}.0 GB; 21.2 GB sharded)" if sharded else f"<= 0.9 x {gb}.0 GB)") in line, line


def test_auto_counts_a_precomputing_reference(llama7b_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the reference is loaded (to precompute its log-probs) while the sharded policy is already placed
    assert auto.frozen_roles(workload_of(_dpo(llama7b_dir, "dpo.precompute_ref_logps=true"))) == ["reference"]
    strategy = _decide(_dpo(llama7b_dir, "distributed.strategy=fsdp", "dpo.precompute_ref_logps=true"),
                       monkeypatch, 24)
    assert strategy.shard_frozen and strategy.frozen_note.startswith("Frozen models sharded (reference: ")
    assert auto.frozen_roles(workload_of(_dpo(llama7b_dir, "dpo.loss_type=simpo", "dpo.reference=auto"))) == []


@pytest.mark.parametrize("setting,sharded", [("true", True), ("false", False)])
def test_explicit_shard_frozen_needs_no_estimate(llama7b_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                 setting: str, sharded: bool) -> None:
    cfg = _dpo(llama7b_dir, "distributed.strategy=fsdp", f"distributed.shard_frozen={setting}")
    strategy = _decide(cfg, monkeypatch, None)
    assert strategy.shard_frozen is sharded
    assert _note(strategy) == [f"Frozen models {'sharded' if sharded else 'replicated'} "
                          f"(reference: distributed.shard_frozen={setting})"]


def test_no_frozen_model_no_decision(llama7b_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = _decide(_sft(llama7b_dir, "distributed.strategy=fsdp"), monkeypatch, None)
    assert strategy.shard_frozen is False and _note(strategy) == []


@pytest.mark.parametrize("engine", [["distributed.strategy=ddp"],
                                    ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=2"]])
def test_shard_frozen_true_without_parameter_sharding_is_an_error(llama7b_dir: Path, engine: list[str]) -> None:
    if "deepspeed" in engine[0]:
        pytest.importorskip("deepspeed")
    cfg = _dpo(llama7b_dir, *engine, "distributed.shard_frozen=true")
    label = "ddp" if len(engine) == 1 else "deepspeed zero_stage 2"
    with pytest.raises(ConfigError, match=f"^distributed.shard_frozen=true: {label} does not shard parameters; "):
        build_strategy(cfg, _env(8))


def test_shard_frozen_true_under_auto_ddp_is_a_note(llama7b_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    frozen_log: list[str]) -> None:
    strategy = _decide(_dpo(llama7b_dir, "distributed.shard_frozen=true"), monkeypatch, 400)  # auto -> ddp
    assert strategy.name == "ddp" and strategy.shard_frozen is False
    note = ("Frozen models replicated (reference: ddp does not shard parameters; "
            "distributed.shard_frozen=true is ignored)")
    assert _note(strategy) == [note]
    # rank 0 logs it once, with the first frozen model
    for _ in range(2):
        strategy.prepare_frozen(torch.nn.Linear(2, 2))
    assert frozen_log == [note]
