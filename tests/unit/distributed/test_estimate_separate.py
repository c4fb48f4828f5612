"""``alignkit estimate`` under ``rollout.placement: separate``: the trainers' table over the trainer processes only,
without the rollout engine's share or the reward model the generators hold, and a generator's own rows (its
weights, KV cache and generation activations, no optimizer state), hand-computed on a small architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignkit.planner.generators import GeneratorInputs, generator_estimate
from alignkit.planner.model_dims import ModelDims
from alignkit.planner.plan import CUDA_OVERHEAD_BYTES
from tests.conftest import write_config

#: 2 layers, hidden 64, MLP 128, vocab 1000, 4 heads of 16 (2 KV heads)
DIMS = ModelDims.llama_like(hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=128, vocab=1000)


def test_generator_rows_by_hand() -> None:
    scorer = ModelDims.llama_like(hidden=32, n_layers=1, n_heads=2, intermediate=64, vocab=1000)
    inp = GeneratorInputs(policy=DIMS, policy_dtype="fp32", compute_dtype="bf16", engine="hf", batch=8, seq_len=100,
                          per_device=2, logits_chunk_rows=64, frozen_models=[scorer])
    rows = generator_estimate(inp)
    assert rows["policy weights"] == DIMS.n_params * 4  # fp32 master weights, as the trainers send them
    assert rows["KV cache"] == 2 * 2 * 2 * 16 * 2 * 8 * 100  # K and V x layers x kv heads x head dim x bf16 x tokens
    layer = (6 * 64 + 3 * 128) * 2  # bytes per token of one layer's live tensors (bf16)
    generate = layer * 8 * 100 + 2 * 4 * 8 * 1000  # prefill of the batch + the last position's fp32 logits / probs
    behaviour = layer * 2 * 100 + 3 * 4 * 64 * 1000  # per_device sequences + one (64, vocab) chunk's fp32 rows
    assert rows["generation activations"] == max(generate, behaviour) == 1_228_800 + 64_000
    assert rows["reward models"] == scorer.n_params * 2 and rows["overhead"] == CUDA_OVERHEAD_BYTES
    assert rows["total"] == sum(v for k, v in rows.items() if k != "total")
    vllm = generator_estimate(GeneratorInputs(policy=DIMS, policy_dtype="fp32", compute_dtype="bf16", engine="vllm",
                                              batch=8, seq_len=100, per_device=2, engine_fraction=0.5), 80 * 10**9)
    assert vllm["vLLM engine"] == 40 * 10**9 and "KV cache" not in vllm  # the engine's cache is in its share
    assert vllm["generation activations"] == generate


@pytest.fixture
def separate_config(micro_model: Path, tmp_path: Path) -> Path:
    from alignkit.config.schema import ModelConfig
    from alignkit.data.synth import make_prompt_rows, write_rows
    from alignkit.models.scalar import load_scalar_model

    rm = tmp_path / "rm"
    load_scalar_model(ModelConfig(name_or_path=str(micro_model)), trainable=False).save_pretrained(rm)
    for f in micro_model.glob("tokenizer*"):
        (rm / f.name).write_bytes(f.read_bytes())
    write_rows(make_prompt_rows(40, seed=0), tmp_path / "prompts.jsonl")
    return write_config(tmp_path / "grpo.yaml", {
        "algorithm": "grpo", "model": {"name_or_path": str(micro_model)},
        "data": {"train": str(tmp_path / "prompts.jsonl"), "max_length": 48},
        "rollout": {"num_generations": 4, "max_new_tokens": 16, "placement": "separate", "generator_processes": 1},
        "training": {"per_device_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 2},
        "reward": {"functions": [{"name": "length", "weight": 0.1}], "model": str(rm)}})


def test_estimate_prints_trainer_and_generator_rows(separate_config: Path) -> None:
    """3 GPUs = 2 trainers + 1 generator, the policy a 0.5B preset: the trainers' table counts 2 ranks and no frozen
    model (the reward model scores on the generator), the generator's rows its fp32 weights (0.49B x 4 bytes)."""
    from alignkit.cli.estimate_command import estimate_command

    text = estimate_command(str(separate_config), [], gpus=3, gpu_memory="80GB", preset="qwen2-0.5b")
    assert "separate, 2 trainer + 1 generator processes" in text and "n_gpus=2" in text
    assert "frozen models" not in text.split("generator processes:")[0]  # the trainers do not hold the reward model
    gen = text.split("generator processes: 1, one GPU each")[1]
    assert "reward models reward" in gen and "no gradients or optimizer states" in gen
    weights = next(line for line in gen.splitlines() if "policy weights" in line)
    assert float(weights.split()[-1]) == pytest.approx(0.494 * 4, abs=0.01)
    assert "KV cache" in gen and "fits (<= 72.0): yes" in gen
    colocated = estimate_command(str(separate_config), ["rollout.placement=colocated"], gpus=3, gpu_memory="80GB",
                                 preset="qwen2-0.5b")
    assert "n_gpus=3" in colocated and "frozen models" in colocated and "generator processes" not in colocated
