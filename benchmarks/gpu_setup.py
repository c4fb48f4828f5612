"""The inputs of ``bench_gpu.py``, each built by one child process of it (the same as ``../shared/gpu``'s
``make_model.py`` / ``make_data.py`` and its GEMM probe, so the numbers stay comparable with issue 38's table).

usage::

    python gpu_setup.py model OUT SIZE      # a random Qwen2.5-shaped model (fp32 safetensors) + the tiny tokenizer
    python gpu_setup.py data OUT N          # N multi-turn SFT rows and N DPO rows (sft.jsonl, dpo.jsonl)
    python gpu_setup.py gemm DEVICE         # the measured GEMM peak: bf16 8192^3 on CUDA, fp32 2048^3 on CPU

SIZE: ``0.5b`` (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocab rows 151936, tied embeddings:
494 M parameters), ``deep`` (the same 24 layers at width 64: CPU op counts) or ``micro`` (2 layers, width 64: the
CPU dry run). The tokenizer is alignkit's tiny BPE tokenizer (trained here, deterministic, no network); the
weights keep Qwen2.5's 151936 vocabulary rows at 0.5b so the LM head costs what a real 0.5B model's does.
Each command prints one JSON line.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: model shapes (the vocabulary of deep / micro is the tokenizer's + 64 rows, as in make_model.py)
DIMS = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "deep": dict(hidden_size=64, num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=176, vocab_size=None),
    "micro": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=176, vocab_size=None),
}


def make_model(out: str, size: str) -> dict[str, object]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from alignkit.models.tiny_base import train_tokenizer

    tok = train_tokenizer(8192)  # the tokenizer of `alignkit tiny-model --size tiny`
    dims = dict(DIMS[size])
    dims["vocab_size"] = dims["vocab_size"] or len(tok) + 64
    cfg = Qwen2Config(**dims, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init of 0.5B: seconds on a GPU
        model = Qwen2ForCausalLM(cfg)
    model.to("cpu", torch.float32).save_pretrained(out)
    tok.model_max_length = 4096
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    return {"size": size, "n_params": n, "vocab_rows": dims["vocab_size"], "tokenizer": len(tok)}


def make_data(out: str, n: int) -> dict[str, object]:
    """make_data.py's rows: conversations of 3-10 arithmetic turns (~500-1600 tokens); DPO rows whose prompt
    is the earlier turns and whose pair is the last turn's chosen / rejected answer."""
    from bench_data import make_rows

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = make_rows(n * 12, seed=0)
    rng = random.Random(0)
    sft, dpo, i = [], [], 0
    for _ in range(n):
        k = rng.randint(3, 10)
        turns = rows[i:i + k]
        i += k
        history: list[dict[str, str]] = []
        for r in turns[:-1]:
            history += r["messages"]
        last = turns[-1]
        sft.append({"messages": history + last["messages"]})
        dpo.append({"prompt": history + last["prompt"], "chosen": last["chosen"], "rejected": last["rejected"]})
    for name, data in (("sft.jsonl", sft), ("dpo.jsonl", dpo)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    return {"rows": n, "dir": str(folder)}


def letter_fraction(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """GRPO's reward on both sides: the fraction of a completion's characters that are ASCII letters. A random
    model's completions differ in it within every group, so no group has zero advantage (an update with all
    advantages zero can be skipped, which would time a different amount of work on each side)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]  # TRL: conversational messages
    return [sum(ch.isascii() and ch.isalpha() for ch in t) / len(t) if t else 0.0 for t in texts]


def gemm_peak(device: str) -> dict[str, object]:
    """The MFU denominator: bf16 8192^3 on CUDA (3 warm-up, mean of 20), fp32 2048^3 on CPU (best of 5)."""
    import torch

    if device == "cuda":
        n, dtype, reps = 8192, torch.bfloat16, 20
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn_like(a)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / reps
        return {"gemm_tflops": 2 * n**3 / dt / 1e12, "gemm": f"bf16 {n}^3", "gpu": torch.cuda.get_device_name()}
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return {"gemm_tflops": 2 * n**3 / best / 1e12, "gemm": f"fp32 {n}^3 (CPU, {torch.get_num_threads()} threads)"}


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "model":
        res = make_model(rest[0], rest[1])
    elif cmd == "data":
        res = make_data(rest[0], int(rest[1]))
    elif cmd == "gemm":
        res = gemm_peak(rest[0])
    else:
        raise SystemExit(f"unknown command {cmd!r}: model | data | gemm")
    print(json.dumps(res))
