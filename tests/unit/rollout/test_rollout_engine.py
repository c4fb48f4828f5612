"""The rollout-engine lifecycle (rollout/engine.py): engines resolved by name (the shipped ones lazily by module),
built from their settings and the run's facts, tokenizer-bound copies that keep the settings, the memory and
importance-sampling settings read through the engine, and a vLLM engine that refuses to generate from weights it
was not given. A plugin engine trained through the CLI: tests/integration/test_seams.py."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

import alignkit.algorithms  # noqa: F401  (registers the algorithms, the engines and their sections)
from alignkit.algorithms import workload_of
from alignkit.algorithms.online import run_engine
from alignkit.config import load_config
from alignkit.errors import ConfigError, UnknownNameError
from alignkit.rollout.engine import (
    ENGINE_MODULES,
    EngineRun,
    HFEngine,
    ImportanceSampling,
    SamplingParams,
    build_engine,
    engine_class,
)
from alignkit.rollout.vllm_engine import VLLMConfig, VLLMEngine

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
#: a vLLM server nobody listens on: the engine is a client, built without vllm installed; nothing is sent
SERVER = "http://127.0.0.1:9"


class Tok:
    eos_token_id, pad_token_id = 2, 0


def test_engines_resolve_by_name_shipped_ones_from_their_module() -> None:
    assert engine_class("hf") is HFEngine and HFEngine.name == "hf"
    for name, module in ENGINE_MODULES.items():
        assert engine_class(name) is getattr(importlib.import_module(module), engine_class(name).__name__)
        assert engine_class(name).name == name
    with pytest.raises(UnknownNameError, match="did you mean 'vllm'"):
        engine_class("vlm")


def test_an_engine_is_built_from_its_section_and_the_run() -> None:
    cfg = load_config(str(CONFIGS / "grpo.yaml"), ["rollout.engine=vllm", f"vllm.server_url={SERVER}",
                                                    "vllm.kv_cache_mb=64", "model.dtype=bf16"])
    engine = build_engine("vllm", Tok(), cfg, max_new_tokens=8)
    assert isinstance(engine, VLLMEngine) and engine.settings == cfg.section(VLLMConfig)
    assert (engine.max_model_len, engine.run_dtype) == (64 + 8, "bf16")  # data.max_length + max_new_tokens
    with pytest.raises(ConfigError, match="one training process talks to a vLLM server"):
        VLLMEngine.from_settings(Tok(), cfg.section(VLLMConfig), EngineRun(72, "bf16", world_size=2))
    assert type(build_engine("hf", Tok(), cfg)) is HFEngine


def test_a_tokenizer_bound_copy_keeps_the_settings() -> None:
    class Other(Tok):
        eos_token_id = 7

    engine = VLLMEngine(Tok(), VLLMConfig(server_url=SERVER, kv_cache_mb=64, dtype="float16"), 72, "bf16")
    copy = engine.with_tokenizer(Other())
    assert isinstance(copy, VLLMEngine) and copy.tokenizer is not engine.tokenizer and copy.eos == [7]
    assert (copy.settings, copy.max_model_len, copy.run_dtype) == (engine.settings, 72, "bf16")
    hf = HFEngine(Tok()).with_tokenizer(Other())
    assert isinstance(hf, HFEngine) and hf.eos == {7}


@pytest.mark.parametrize("overrides,fraction,weights", [
    ([], 0.0, None),  # hf: the training module itself samples
    (["rollout.engine=vllm", "vllm.gpu_memory_utilization=0.4"], 0.4, ImportanceSampling("token_truncate", 3.0)),
    (["rollout.engine=vllm", "vllm.sleep_mode=true", "vllm.importance_sampling_mode=sequence_mask",
      "vllm.importance_sampling_cap=2"], 0.0, ImportanceSampling("sequence_mask", 2.0)),
    (["rollout.engine=vllm", "vllm.importance_sampling=false"], 0.3, None),
])
def test_memory_and_importance_sampling_are_the_engines(overrides: list[str], fraction: float,
                                                         weights: ImportanceSampling | None) -> None:
    cfg = load_config(str(CONFIGS / "grpo.yaml"), overrides)
    engine, settings = run_engine(cfg)
    assert engine.importance_sampling(settings) == weights
    assert workload_of(cfg).reserved_fraction == engine.reserved_memory_fraction(settings) == fraction


def test_the_cost_estimate_engine_reserves_its_share() -> None:
    """safe_dpo's J_C estimate generates with the run's engine: a colocated vLLM engine's share is reserved while
    the estimate runs (cost_eval_every > 0), none without it."""
    safe = str(CONFIGS / "safe_dpo.yaml")
    on = ["rollout.engine=vllm", "vllm.gpu_memory_utilization=0.2"]
    assert workload_of(load_config(safe, on)).reserved_fraction == 0.2
    assert workload_of(load_config(safe, [*on, "safe_dpo.cost_eval_every=0"])).reserved_fraction == 0.0
    assert workload_of(load_config(safe)).reserved_fraction == 0.0


def test_vllm_generates_only_from_weights_it_was_given() -> None:
    """Weight sync is the caller's explicit step (``generation_phase``): generate from a module whose weights were not
    pushed is an error, not a sample of stale weights."""
    engine: Any = VLLMEngine(Tok(), VLLMConfig(server_url=SERVER))
    with pytest.raises(RuntimeError, match=r"call sync_weights\(model\) first"):
        engine.generate(torch.nn.Linear(2, 2), [[1, 2]], SamplingParams(4))


class Scripted(torch.nn.Module):
    """A 'model' whose generate appends fixed completions (one row each) to the prompts."""

    def __init__(self, rows: list[list[int]]) -> None:
        super().__init__()
        self.w, self.rows = torch.nn.Parameter(torch.zeros(1)), rows

    def generate(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return torch.cat([input_ids, torch.tensor(self.rows)], 1)


def test_completions_decode_as_whole_sequences_and_drop_a_character_cut_at_the_end() -> None:
    """The byte-level BPE of the tiny models spells 'é', '☃' and '日本' over several tokens each (a token alone
    decodes to U+FFFD): a completion's text is its whole sequence decoded, and one cut by max_new_tokens in the
    middle of '本' (3 bytes) ends at '日', not at U+FFFD; the ids keep every token."""
    from alignkit.models.tiny_base import train_tokenizer

    tok = train_tokenizer(512)
    text = "café ☃ 日本"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids[-1:]) == "\ufffd" and "\ufffd" in "".join(tok.decode([i]) for i in ids)
    cut = tok(text[:-1], add_special_tokens=False)["input_ids"] + tok("本", add_special_tokens=False)["input_ids"][:1]
    assert tok.decode(cut).endswith("\ufffd")  # what the text was before
    done = tok("☃ 日本", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # HF pads a finished row
    rows = [done + [tok.pad_token_id] * (len(cut) - len(done)), cut]
    gens = HFEngine(tok).generate(Scripted(rows), [[5, 6], [7, 8]], SamplingParams(len(cut), 0.0))
    assert gens.texts == ["☃ 日本", "café ☃ 日"]
    assert gens.completion_ids == [done, cut] and gens.finish_reasons == ["stop", "length"]
