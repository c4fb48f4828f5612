"""Memory plan: parameter counts, saved-activation arithmetic, ZeRO sharding, strategy choice.

Run ``pytest tests/unit/distributed/test_plan.py -s`` to see the seed-scenario tables (copyable into a note).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from alignkit.planner.activations import activation_breakdown
from alignkit.planner.model_dims import PRESETS, dims_from_hf_config, dims_from_pretrained
from alignkit.planner.plan import (
    GB,
    GIB,
    MemoryInputs,
    choose_shard_frozen,
    choose_strategy,
    estimate,
    fits,
    parse_memory,
    trainable_params,
)
from alignkit.planner.plan_report import format_table
from tests.unit.distributed.peak_rss import measure

LLAMA7B = PRESETS["llama-7b"]
RM7B = LLAMA7B.as_score_model()


def _tiny_config(**kw) -> LlamaConfig:
    base = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=300, attn_implementation="sdpa")
    return LlamaConfig(**{**base, **kw})


# --------------------------------------------------------------------------- parameter counts
@pytest.mark.parametrize("kv_heads,tied", [(4, False), (2, False), (1, True), (2, True)])
def test_n_params_matches_real_llama(kv_heads: int, tied: bool) -> None:
    cfg = _tiny_config(num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    assert dims_from_hf_config(cfg).n_params == sum(p.numel() for p in model.parameters())


def test_n_params_with_biases_and_head_dim() -> None:
    cfg = _tiny_config(attention_bias=True, mlp_bias=True, head_dim=32, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    assert dims_from_hf_config(cfg).n_params == sum(p.numel() for p in model.parameters())


def test_presets_match_published_sizes() -> None:
    assert PRESETS["llama-7b"].n_params == 6_738_415_616
    assert PRESETS["mistral-7b"].n_params == 7_241_732_096
    assert PRESETS["qwen2-0.5b"].n_params == 494_032_768
    assert RM7B.n_params == 6_738_415_616 - 32000 * 4096 + 4096


def test_dims_from_pretrained_local_dir(tmp_path) -> None:
    cfg = _tiny_config(num_key_value_heads=2)
    cfg.save_pretrained(tmp_path)
    assert dims_from_pretrained(str(tmp_path)) == dims_from_hf_config(cfg)


def test_lora_trainable_params_match_peft() -> None:
    from peft import LoraConfig, get_peft_model

    from alignkit.models.loading import quiet_peft

    cfg = _tiny_config(num_key_value_heads=2)
    with quiet_peft():
        model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(
            r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]))
    inputs = MemoryInputs(policy=dims_from_hf_config(cfg), lora_r=8,
                          lora_targets=["q", "k", "v", "o", "down"])
    assert trainable_params(inputs) == sum(p.numel() for p in model.parameters() if p.requires_grad)


# --------------------------------------------------------------------------- activations
def _saved_bytes(model: torch.nn.Module, batch: int, seq: int, vocab: int) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward with labels."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, vocab, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


@pytest.mark.parametrize("dtype,kv,lora,dropout,fused,targets", [
    ("fp32", 4, None, 0.0, False, "qkvo+down"), ("bf16", 2, None, 0.0, False, "qkvo+down"),
    ("bf16", 4, 4, 0.0, False, "qkvo+down"), ("fp32", 2, 4, 0.1, False, "qkvo+down"),
    # training.fused_layers (models/fused.py): full fine-tuning, LoRA on an MLP projection (that MLP stays
    # unfused, the norms fuse) and LoRA on attention only (the frozen MLP fuses too)
    ("fp32", 4, None, 0.0, True, "qkvo+down"), ("bf16", 2, None, 0.0, True, "qkvo+down"),
    ("bf16", 4, 4, 0.0, True, "qkvo+down"), ("fp32", 2, 4, 0.1, True, "qkvo"), ("bf16", 2, 4, 0.0, True, "qkvo")])
def test_activation_formula_matches_saved_tensors(dtype: str, kv: int, lora, dropout: float, fused: bool,
                                                  targets: str) -> None:
    """The per-layer formula equals what autograd really keeps (to RoPE cos/sin and ids, < 1%)."""
    from alignkit.models.fused import apply_fused_layers

    torch.manual_seed(0)
    cfg = _tiny_config(num_key_value_heads=kv, num_hidden_layers=3)
    model = LlamaForCausalLM(cfg).to(torch.float32 if dtype == "fp32" else torch.bfloat16).train()
    targets = ["q", "k", "v", "o"] + (["down"] if targets == "qkvo+down" else [])
    if lora:
        from peft import LoraConfig, get_peft_model

        from alignkit.models.loading import quiet_peft

        with quiet_peft():
            model = get_peft_model(model, LoraConfig(r=lora, lora_dropout=dropout, target_modules=[
                f"{t}_proj" for t in targets]))
    if fused:
        counts = apply_fused_layers(model)
        assert counts == {"mlp": 0 if lora and "down" in targets else 3, "rmsnorm": 7}, counts
    inputs = MemoryInputs(policy=dims_from_hf_config(cfg), param_dtype=dtype, per_device_batch=2,
                          seq_len=32, chunked_logits=False, lora_r=lora, lora_targets=targets,
                          lora_dropout=dropout, device="cpu", fused_layers=fused)
    part = activation_breakdown(inputs)
    # saved for backward = layers + final norm + fp32 log-softmax (the logits themselves are held
    # by the model output, not saved; the backward transients come later)
    predicted = part["layers"] + part["final_norm"] + 4 * cfg.vocab_size * inputs.tokens
    measured = _saved_bytes(model, 2, 32, cfg.vocab_size)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


# --------------------------------------------------------------------------- seed scenario
def _seed(**kw) -> MemoryInputs:
    """Seed guide 004: 7B policy bf16 + reference + helpful/harmless RMs, 8 x 64 GB, batch 4 x 512,
    chosen + rejected per example, gradient checkpointing on (its 5-10 GB of activations need it)."""
    base = dict(policy=LLAMA7B, param_dtype="bf16", reference="model", frozen_models=[RM7B, RM7B],
                per_device_batch=4, seq_len=512, sequences_per_example=2,
                gradient_checkpointing=True, n_gpus=8)
    return MemoryInputs(**{**base, **kw})


STRATS = ("ddp", "zero1", "zero2", "zero3", "zero3_offload")


def test_seed_full_finetune_components() -> None:
    full = _seed(master_weights_fp32=True)
    e = estimate(full, "ddp")
    p = LLAMA7B.n_params
    assert e.gpu["policy weights"] == 2 * p == 13_476_831_232
    assert e.gpu["master weights (fp32)"] == 4 * p
    assert e.gpu["gradients"] == 2 * p
    assert e.gpu["optimizer states"] == 8 * p  # two fp32 Adam moments: 53.9 GB, not the seed's 28
    assert e.gpu["reference model"] == 2 * p
    assert e.gpu["frozen models"] == 2 * 2 * RM7B.n_params
    assert e.gpu["activations"] == 1_971_896_320  # 32 x checkpointed (4096 tok, 4096 h) bf16 + 1 layer
    assert e.gpu["overhead"] == 1_500_000_000
    assert e.total == 18 * p + 4 * RM7B.n_params + 1_971_896_320 + 1_500_000_000  # 151.2 GB
    # the seed's own arithmetic (no fp32 master, 28 GB of optimizer state = bf16 moments) lands at
    # its ~103 GB once its 5-10 GB activation guess replaces our 2.0 GB
    seed = estimate(_seed(optimizer_state_dtype="bf16"), "ddp")
    assert seed.gpu["optimizer states"] == 4 * p
    assert 95 * GB < seed.total < 105 * GB
    print("\n" + format_table(full, {s: estimate(full, s) for s in STRATS}, parse_memory("64GB")))
    print("\nseed arithmetic (bf16 Adam moments, no master copy):")
    print(format_table(seed_in := _seed(optimizer_state_dtype="bf16"),
                       {s: estimate(seed_in, s) for s in STRATS}, parse_memory("64GB")))


def test_seed_lora_in_quoted_range() -> None:
    lora = _seed(lora_r=16, lora_targets=["q", "k", "v", "o"], lora_dropout=0.1)
    e = estimate(lora, "ddp")
    assert trainable_params(lora) == 16_777_216
    assert e.gpu["policy weights"] == 2 * LLAMA7B.n_params + 4 * 16_777_216
    assert e.gpu["gradients"] == 4 * 16_777_216  # peft keeps adapters in fp32
    assert e.gpu["optimizer states"] == 8 * 16_777_216
    assert e.gpu["master weights (fp32)"] == 0
    assert 55 * GB < e.total < 66 * GB  # seed: ~55-66 GB per GPU
    print("\n" + format_table(lora, {s: estimate(lora, s) for s in STRATS}, parse_memory("64GB")))


# --------------------------------------------------------------------------- sharding + choice
def test_zero_stages_divide_by_n_gpus() -> None:
    inp = _seed(master_weights_fp32=True, shard_frozen=True)
    ddp, z1, z2, z3 = (estimate(inp, s) for s in ("ddp", "zero1", "zero2", "zero3"))
    n = inp.n_gpus
    assert z1.gpu["optimizer states"] == ddp.gpu["optimizer states"] // n
    assert z1.gpu["master weights (fp32)"] == ddp.gpu["master weights (fp32)"] // n
    assert z1.gpu["gradients"] == ddp.gpu["gradients"]
    assert z2.gpu["gradients"] == ddp.gpu["gradients"] // n
    assert z2.gpu["policy weights"] == ddp.gpu["policy weights"]
    assert z3.gpu["policy weights"] == ddp.gpu["policy weights"] // n
    assert z3.gpu["frozen models"] == ddp.gpu["frozen models"] // n
    assert z2.gpu["frozen models"] == ddp.gpu["frozen models"]  # replicated below stage 3
    assert estimate(inp, "fsdp").gpu == z3.gpu
    # FSDP without resharding is ZeRO-2-like for the policy, but still shards frozen models
    frozen_rows = ("reference model", "frozen models")
    grad_op = estimate(inp, "fsdp_grad_op").gpu
    assert grad_op == {**z2.gpu, **{k: z3.gpu[k] for k in frozen_rows}}
    off = estimate(inp, "zero3_offload")
    assert "optimizer states" not in off.gpu and off.cpu["optimizer states"] == z3.gpu["optimizer states"]
    assert off.total < z3.total < z2.total < z1.total < ddp.total


def test_choose_strategy() -> None:
    small = MemoryInputs(policy=PRESETS["qwen2-0.5b"], param_dtype="bf16", master_weights_fp32=True,
                         per_device_batch=4, seq_len=1024, n_gpus=8)
    assert choose_strategy(small, parse_memory("80GB"))[0] == "ddp"
    name, why = choose_strategy(_seed(master_weights_fp32=True, shard_frozen=True), parse_memory("64GB"))
    assert name == "zero3" and "zero2 needs 68.6 GB/GPU > 57.6 GB usable" in why, why
    name, why = choose_strategy(_seed(optimizer_state_dtype="bf16"), parse_memory("64GB"))
    assert name == "zero3", why
    # replicated reference + RMs leave zero3 0.5 GB short: only offload fits
    assert choose_strategy(_seed(master_weights_fp32=True), parse_memory("64GB"))[0] == "zero3_offload"
    print("\n" + why)


def test_a_colocated_rollout_engine_share_is_left_out() -> None:
    """rollout.engine: vllm holds vllm.gpu_memory_utilization of each GPU: the training state gets the rest."""
    small = MemoryInputs(policy=PRESETS["qwen2-0.5b"], param_dtype="bf16", master_weights_fp32=True,
                         per_device_batch=4, seq_len=1024, n_gpus=8)
    need = estimate(small, "ddp").total
    memory = int(need / 0.8)  # ddp fits in 0.9 of it, not in 0.9 - 0.3
    assert choose_strategy(small, memory)[0] == "ddp"
    name, why = choose_strategy(MemoryInputs(**{**small.__dict__, "reserved_fraction": 0.3}), memory)
    assert name != "ddp" and f"{0.6 * memory / 1e9:.1f} GB usable" in why, why


def test_vllm_engine_reserves_its_share_unless_it_sleeps() -> None:
    from alignkit.algorithms import workload_of
    from alignkit.config import load_config

    grpo = Path(__file__).resolve().parents[3] / "configs" / "grpo.yaml"
    assert workload_of(load_config(str(grpo))).reserved_fraction == 0.0  # engine: hf
    on = load_config(str(grpo), ["rollout.engine=vllm", "vllm.gpu_memory_utilization=0.4"])
    assert workload_of(on).reserved_fraction == 0.4
    assert workload_of(load_config(str(grpo), ["rollout.engine=vllm", "vllm.sleep_mode=true"])).reserved_fraction == 0.0


def _frozen_pair(inp: MemoryInputs, strategy: str):
    return tuple(estimate(MemoryInputs(**{**inp.__dict__, "shard_frozen": s}), strategy) for s in (False, True))


@pytest.mark.parametrize("strategy,memory,want,reason", [
    # the seed at 64 GB: zero3 with replicated reference + RMs is 0.5 GB short, sharded it fits
    ("zero3", "64GB", True, "58.1 GB per rank with them replicated (39.9 GB) > 0.9 x 64.0 GB; 23.2 GB sharded"),
    ("fsdp", "80GB", False, "58.1 GB per rank with them replicated (39.9 GB) <= 0.9 x 80.0 GB"),  # fits: no all-gathers
    ("fsdp_grad_op", "64GB", True, "> 0.9 x 64.0 GB; "),  # FSDP shards frozen models whatever the resharding
    ("zero3", "20GB", True, "sharded (still over: expect OOM)"),  # smaller is still better
    ("ddp", "64GB", False, "ddp does not shard parameters"),
    ("zero2", "1GB", False, "zero2 does not shard parameters"),
    ("zero3", None, False, "device memory unknown"),
])
def test_choose_shard_frozen(strategy: str, memory: str | None, want: bool, reason: str) -> None:
    replicated, sharded = _frozen_pair(_seed(master_weights_fp32=True), strategy)
    got, why = choose_shard_frozen(replicated, sharded, parse_memory(memory) if memory else None)
    assert got is want and reason in why, why


def test_choose_shard_frozen_needs_frozen_models_and_ranks() -> None:
    none = _seed(master_weights_fp32=True, reference="none", frozen_models=[])
    assert choose_shard_frozen(*_frozen_pair(none, "zero3"), 1) == (False, "no frozen model is held")
    one_rank = _seed(master_weights_fp32=True, n_gpus=1)
    got, why = choose_shard_frozen(*_frozen_pair(one_rank, "zero3"), parse_memory("64GB"))
    assert not got and "sharding them saves nothing" in why
    lora_base = _seed(lora_r=16, reference="lora_base", frozen_models=[])  # the reference is the policy itself
    assert choose_shard_frozen(*_frozen_pair(lora_base, "fsdp"), 1)[0] is False


def test_parameter_count_fallback() -> None:
    def pick(dims, **kw):
        return choose_strategy(MemoryInputs(policy=dims), None, **kw)

    name, why = pick(PRESETS["qwen2-0.5b"])
    assert name == "ddp" and "device memory unknown" in why
    assert pick(LLAMA7B)[0] == "zero2" and pick(PRESETS["mistral-7b"])[0] == "zero2"
    big = PRESETS["llama-7b"].__class__.llama_like(hidden=5120, n_layers=40, n_heads=40,
                                                   intermediate=13824, vocab=32000)  # Llama-2-13B
    assert pick(big)[0] == "zero3"
    assert pick(LLAMA7B, available=("ddp", "zero3"))[0] == "zero3"


def test_fits_headroom() -> None:
    e = estimate(_seed(lora_r=16), "ddp")
    assert fits(e, e.total) is False and fits(e, e.total, headroom=1.0) is True


def test_parse_memory() -> None:
    assert parse_memory("80GB") == parse_memory("80G") == 80 * 10**9
    assert parse_memory("64GiB") == 64 * GIB and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory(" 1.5 gb ") == 1_500_000_000
    with pytest.raises(ValueError, match="'80GB'"):
        parse_memory("eighty gigs")
    with pytest.raises(ValueError):
        parse_memory("80XB")


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="strategy"):
        estimate(MemoryInputs(policy=LLAMA7B), "zero4")
    with pytest.raises(ValueError, match="lora_targets"):
        MemoryInputs(policy=LLAMA7B, lora_r=8, lora_targets=["qkv"])
    with pytest.raises(ValueError, match="reference"):
        MemoryInputs(policy=LLAMA7B, reference="copy")


# --------------------------------------------------------------------------- CPU measurement
_MEASURE = textwrap.dedent("""
    import json
    import psutil, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=12, vocab_size=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    reset_peak()
    baseline = psutil.Process().memory_info().rss
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for batch, seq in ((1, 8), (4, 256)):  # step 1 only allocates grads + Adam states; step 2 peaks
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # persistent grads, like DDP buckets / ZeRO buffers
    print(json.dumps({"baseline": baseline, "peak": peak_bytes()}))
""")


@pytest.mark.slow
def test_cpu_estimate_matches_measured_peak_rss() -> None:
    # peak_rss.measure: a fresh child, its own peak (not the worker's), glibc's mmap threshold pinned
    m = measure(_MEASURE, threads=2, timeout=120)
    dims = dims_from_hf_config(LlamaConfig(hidden_size=768, intermediate_size=2048,
                                           num_hidden_layers=8, num_attention_heads=12, vocab_size=8192))
    inputs = MemoryInputs(policy=dims, param_dtype="fp32", per_device_batch=4, seq_len=256,
                          chunked_logits=False, device="cpu", optimizer_impl="for_loop",
                          process_baseline_bytes=m["baseline"])
    est = estimate(inputs, "ddp")
    measured, predicted = m["peak"] - m["baseline"], est.total - m["baseline"]
    print(f"\nCPU check: baseline {m['baseline'] / 1e6:.0f} MB, measured peak-baseline "
          f"{measured / 1e6:.0f} MB, predicted {predicted / 1e6:.0f} MB "
          f"({(predicted - measured) / measured:+.1%})")
    print(format_table(inputs, {"ddp (cpu)": est}))
    assert abs(predicted - measured) / measured < 0.20
