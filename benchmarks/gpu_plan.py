"""What ``bench_gpu.py`` runs: the workloads per model size, the variants in priority order (each TRL row right
after its alignkit pair), the pairs the summary compares, and each variant's alignkit config or TRL spec
(``gpu_trl.py``). Standard library only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LORA = {"r": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
#: per model size: the main workload, the GPU-filling one and GRPO's (steps, warm = steps before the window)
WORKLOADS: dict[str, dict[str, Any]] = {
    "0.5b": {"batch": 8, "accum": 1, "steps": 15, "warm": 5, "log": 5, "rows": 512, "max_length": 2048,
             "fill": {"batch": 16, "accum": 2, "steps": 8, "warm": 4, "log": 4},
             "grpo": {"batch": 64, "G": 8, "max_new": 48, "steps": 6, "warm": 2}},
    # the CPU pipeline check (tests/unit/benchmarks/test_bench_gpu.py): one timed window of 2 steps after 2 warm
    "micro": {"batch": 2, "accum": 1, "steps": 4, "warm": 2, "log": 2, "rows": 48, "max_length": 256,
              "fill": {"batch": 2, "accum": 2, "steps": 3, "warm": 1, "log": 1},
              "grpo": {"batch": 16, "G": 8, "max_new": 8, "steps": 3, "warm": 1}},
}
WORKLOADS["deep"] = WORKLOADS["0.5b"]
#: in priority order; kind: how MFU counts FLOPs; TRL's LoRA / checkpointing / fill rows are padding-free (its best)
VARIANTS: list[dict[str, Any]] = [
    {"name": "ak_sft", "side": "alignkit", "algo": "sft", "kind": "sft", "profile": True},
    {"name": "trl_sft_pf", "side": "trl", "algo": "sft", "variant": "padding_free", "attn": "varlen", "kind": "sft",
     "profile": True},
    {"name": "trl_sft_padded", "side": "trl", "algo": "sft", "variant": "padded", "kind": "sft"},
    {"name": "ak_dpo", "side": "alignkit", "algo": "dpo", "kind": "dpo", "profile": True},
    {"name": "trl_dpo", "side": "trl", "algo": "dpo", "variant": "base", "kind": "dpo", "bf16_frozen": True},
    {"name": "ak_grpo", "side": "alignkit", "algo": "grpo", "kind": None},
    {"name": "trl_grpo", "side": "trl", "algo": "grpo", "kind": None},
    {"name": "ak_lora", "side": "alignkit", "algo": "sft", "kind": "lora", "lora": True},
    {"name": "trl_lora", "side": "trl", "algo": "sft", "variant": "padding_free", "attn": "varlen", "kind": "lora",
     "lora": True, "bf16_frozen": True},
    {"name": "trl_sft_pf_liger", "side": "trl", "algo": "sft", "variant": "padding_free", "attn": "varlen",
     "kind": "sft", "liger": True},
    {"name": "ak_fill", "side": "alignkit", "algo": "sft", "kind": "sft", "fill": True},
    {"name": "trl_fill", "side": "trl", "algo": "sft", "variant": "padding_free", "attn": "varlen", "kind": "sft",
     "fill": True},
    {"name": "ak_gc", "side": "alignkit", "algo": "sft", "kind": "sft", "gc": True},
    {"name": "trl_gc", "side": "trl", "algo": "sft", "variant": "padding_free", "attn": "varlen", "kind": "sft",
     "gc": True},
    # training.torch_compile (regional, the decoder blocks) on the GPU-filling workload: its wall time less
    # ak_fill's is about the compile
    {"name": "ak_fill_compile", "side": "alignkit", "algo": "sft", "kind": "sft", "fill": True, "compile": True},
]
#: (alignkit row, TRL row) compared in the summary
PAIRS = [("ak_sft", "trl_sft_pf"), ("ak_sft", "trl_sft_padded"), ("ak_sft", "trl_sft_pf_liger"), ("ak_dpo", "trl_dpo"),
         ("ak_lora", "trl_lora"), ("ak_gc", "trl_gc"), ("ak_fill", "trl_fill"), ("ak_grpo", "trl_grpo"),
         ("ak_fill_compile", "trl_fill")]
def shape(v: dict[str, Any], wl: dict[str, Any]) -> dict[str, Any]:
    """Batch, accumulation, steps, warm-up and logging interval of variant ``v``."""
    base = {k: wl[k] for k in ("batch", "accum", "steps", "warm", "log")}
    if v.get("fill"):
        base.update(wl["fill"])
    if v["algo"] == "grpo":
        base.update({k: wl["grpo"][k] for k in ("batch", "steps", "warm")}, accum=1, log=1)
    return base


def alignkit_config(v: dict[str, Any], wl: dict[str, Any], paths: dict[str, Path], run_dir: Path,
                    log_steps: int | None = None, steps: int | None = None) -> dict[str, Any]:
    """probe.sh's config for variant ``v`` (the attention kernel is alignkit's default, unlike probe.sh's sdpa)."""
    s = shape(v, wl)
    model: dict[str, Any] = {"name_or_path": str(paths["model"]), "dtype": "auto", "gradient_checkpointing": bool(v.get("gc"))}
    if v.get("lora"):
        model["lora"] = LORA
    cfg: dict[str, Any] = {"algorithm": v["algo"], "output_dir": str(run_dir), "model": model,
                           "checkpoint": {"save_final": False},
                           "logging": {"logging_steps": log_steps or s["log"], "report_to": ["console", "jsonl"],
                                       "progress_bar": "off", "plot": False}}
    train = {"per_device_batch_size": s["batch"], "gradient_accumulation_steps": s["accum"], "learning_rate": 1.0e-5,
             "lr_scheduler": "constant", "warmup_steps": 0, "max_steps": steps or s["steps"], "max_grad_norm": 1.0,
             "weight_decay": 0.0, "seed": 0, "torch_compile": bool(v.get("compile"))}
    if v["algo"] == "sft":
        cfg["data"] = {"train": str(paths["data"] / "sft.jsonl"), "max_length": wl["max_length"], "packing": True}
        cfg["sft"] = {"loss_on": "all"}  # TRL's objective on messages rows
    elif v["algo"] == "dpo":
        cfg["data"] = {"train": str(paths["data"] / "dpo.jsonl"), "max_length": wl["max_length"]}
        cfg["dpo"] = {"loss_type": "sigmoid", "beta": 0.1, "reference": "model"}
    else:
        g = wl["grpo"]
        cfg["data"] = {"train": str(paths["prompts"]), "max_length": 64}
        cfg["rollout"] = {"num_generations": g["G"], "max_new_tokens": g["max_new"], "temperature": 1.0, "log_samples": 0}
        cfg["reward"] = {"functions": [{"name": "gpu_setup:letter_fraction", "weight": 1.0}]}
        cfg["grpo"] = {"beta": 0.0}
        train.update(learning_rate=1.0e-6)
    cfg["training"] = train
    return cfg


def trl_spec(v: dict[str, Any], wl: dict[str, Any], paths: dict[str, Path], out: Path, steps: int | None = None) -> dict[str, Any]:
    s = shape(v, wl)
    spec = {"algo": v["algo"], "variant": v.get("variant", "base"), "model": str(paths["model"]), "data": str(paths["data"]),
            "out": str(out), "steps": steps or s["steps"], "batch": s["batch"], "accum": s["accum"],
            "max_length": wl["max_length"], "lora": bool(v.get("lora")), "gc": bool(v.get("gc"))}
    spec.update({k: v[k] for k in ("attn", "liger", "bf16_frozen") if k in v})
    if v["algo"] == "grpo":
        spec.update(prompts=str(paths["prompts"]), num_generations=wl["grpo"]["G"], max_new_tokens=wl["grpo"]["max_new"],
                    lr=1e-6)
    return spec
