"""The ``hf`` engine's fast path (``hf_generate.static_cache`` / ``compile_decode``, rollout/engine.py): the static
KV cache and a compiled decode step give the same samples as the default dynamic cache for the same seed, greedy
and sampled, on the micro model (sampled draws can differ where float round-off of the attention over the longer
static cache flips a draw at a probability boundary: 1 of 64 rows x 48 tokens on the tiny model,
benchmarks/bench_generate.py; none on these rows, every run: the seed is fixed); the completions' log-probs are the training forward's either way, so the first
GRPO ratio is exactly 1; the settings are read from the run config and refused in a combination that cannot work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import alignkit.algorithms  # noqa: F401  (registers the algorithms, the engines and their sections)
from alignkit.config import load_config
from alignkit.errors import ConfigError
from alignkit.rollout.engine import HFEngine, HFGenerateConfig, SamplingParams, build_engine, cache_kwargs
from tests.unit.rollout.test_sampling_logps import first_update, online_setup

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TEXTS = ["a", "the quick brown fox jumps", "1 2 3 4 5 6 7 8 9 10 11 12 13", "hello world"] * 3
STATIC = HFGenerateConfig(static_cache=True)


@pytest.fixture(scope="module")
def lm(micro_model: Path) -> tuple[Any, Any, list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(micro_model)).eval()
    tok = AutoTokenizer.from_pretrained(str(micro_model))
    return model, tok, tok(TEXTS, add_special_tokens=False)["input_ids"]


def _sample(model: Any, tok: Any, ids: list[list[int]], settings: HFGenerateConfig, temperature: float,
            seed: int = 3) -> list[list[int]]:
    torch.manual_seed(seed)
    return HFEngine(tok, settings).generate(model, ids, SamplingParams(12, temperature, batch_size=64)).completion_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_cache_samples_what_the_dynamic_cache_samples(lm: tuple[Any, Any, list[list[int]]],
                                                             temperature: float) -> None:
    model, tok, ids = lm
    default = _sample(model, tok, ids, HFGenerateConfig(), temperature)
    assert _sample(model, tok, ids, STATIC, temperature) == default
    assert len({tuple(r) for r in default}) >= 4  # 4 prompts of different lengths: left padding in one batch
    if temperature:  # the test can tell draws apart: another seed gives other samples
        assert _sample(model, tok, ids, STATIC, temperature, seed=4) != default


def test_the_compiled_decode_step_samples_the_same(lm: tuple[Any, Any, list[list[int]]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled path end to end (transformers' compiled static-cache decode), with dynamo's eager backend in
    place of inductor so the test does not spend a minute in code generation: the graph capture and the
    static-shape decode loop are the ones a GPU run compiles."""
    import transformers

    made: list[Any] = []

    class EagerCompile(transformers.CompileConfig):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**{**kw, "backend": "eager"})
            made.append(self)

    monkeypatch.setattr(transformers, "CompileConfig", EagerCompile)
    model, tok, ids = lm
    compiled = HFGenerateConfig(static_cache=True, compile_decode=True)
    torch._dynamo.reset()
    try:
        assert _sample(model, tok, ids, compiled, 1.0) == _sample(model, tok, ids, HFGenerateConfig(), 1.0)
    finally:
        torch._dynamo.reset()
    assert made and made[0]._compile_all_devices and made[0].mode == "default"  # CPU: no CUDA graphs


def test_the_generate_arguments_of_each_setting() -> None:
    assert cache_kwargs(HFGenerateConfig(), torch.device("cpu")) == {}
    # transformers compiles a static-cache decode on CUDA by itself: off unless compile_decode asks
    assert cache_kwargs(STATIC, torch.device("cuda")) == {"cache_implementation": "static", "disable_compile": True}
    on_gpu = cache_kwargs(HFGenerateConfig(True, True), torch.device("cuda"))
    assert on_gpu["cache_implementation"] == "static" and on_gpu["compile_config"].mode == "reduce-overhead"
    with pytest.raises(ConfigError, match="compile_decode=true needs hf_generate.static_cache=true"):
        HFGenerateConfig(compile_decode=True)


def test_the_engine_reads_its_section_and_keeps_it_per_tokenizer() -> None:
    cfg = load_config(str(CONFIGS / "grpo.yaml"), ["hf_generate.static_cache=true"])
    engine = build_engine("hf", _Tok(), cfg)
    assert isinstance(engine, HFEngine) and engine.settings == STATIC
    assert engine.with_tokenizer(_Tok()).settings == STATIC
    assert build_engine("hf", _Tok()).settings == HFGenerateConfig()  # defaults: the dynamic cache


class _Tok:
    eos_token_id, pad_token_id = 2, 0


def test_first_grpo_ratio_is_exactly_one_with_the_static_cache(micro_model: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    algo, models, ctx = online_setup(micro_model)
    ctx.engine = HFEngine(ctx.engine.tokenizer, STATIC)
    _, new, old, _ = first_update(algo, models, ctx, monkeypatch)
    assert torch.equal(new, old)


def test_the_static_cache_reads_the_host_once_per_token(lm: tuple[Any, Any, list[list[int]]]) -> None:
    """Host reads (``_local_scalar_dense``, ``nonzero``, ...) of one generate call of 24 new tokens, counted as
    ``../shared/gpu/opcount.py`` counts them. Measured on 12 micro-model prompts like these: static 30 (one stop
    check per token + 6 at the start), dynamic 54 (about two per token)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    sync_ops = {"_local_scalar_dense", "nonzero", "unique", "masked_select", "equal", "is_nonzero"}

    class Syncs(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.count += func.overloadpacket.__name__ in sync_ops
            return func(*args, **(kwargs or {}))

    model, tok, ids = lm
    counts = {}
    for settings in (HFGenerateConfig(), STATIC):
        with Syncs() as syncs:
            HFEngine(tok, settings).generate(model, ids, SamplingParams(24, 1.0, batch_size=64))
        counts[settings.static_cache] = syncs.count
    assert counts[True] <= 24 + 8 and counts[True] < counts[False], counts
