"""Rollout throughput of ``rollout.engine: vllm`` vs ``hf`` on the same model and prompts, side by side.

Run in the vLLM virtualenv (.ci/vllm_env), on an idle machine:

    python benchmarks/bench_vllm.py                         # tiny random Llama (micro64 and tiny sizes), CPU
    python benchmarks/bench_vllm.py --model PATH --device cuda --dtype bfloat16 --prompts 256 --max-new-tokens 256

For each engine: one warm-up rollout (vLLM's engine start is timed apart), then ``--repeats`` timed rollouts of
``--prompts`` prompts x ``--num-generations`` samples at temperature 1 with ``max_new_tokens`` tokens; the
figure is generated tokens / wall seconds (what the online loop logs as ``gen_tokens_per_s``). Both engines get
the same weights (the vLLM engine is synced from the HF module before the timed calls).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def rollout_rate(engine: Any, model: Any, prompts: list[list[int]], params: Any, repeats: int) -> dict[str, float]:
    """Tokens/s of ``repeats`` timed calls after one warm-up (its time reported apart)."""
    start = time.perf_counter()
    engine.generate(model, prompts, params)
    warm = time.perf_counter() - start
    tokens, seconds = 0, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        gens = engine.generate(model, prompts, params)
        seconds += time.perf_counter() - start
        tokens += sum(len(c) for c in gens.completion_ids)
    return {"warmup_s": round(warm, 2), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: build tiny random Llamas)")
    ap.add_argument("--sizes", default="micro64,tiny", help="tiny sizes to build without --model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignkit.models.tiny import build_tiny_model
    from alignkit.rollout.engine import HFEngine, SamplingParams
    from alignkit.rollout.vllm_engine import VLLMConfig, VLLMEngine

    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    models = [Path(args.model)] if args.model else [build_tiny_model(work / s, size=s, seed=0) for s in args.sizes.split(",")]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, batch_size=args.prompts * args.num_generations)
    results = []
    for path in models:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        words = ["What is", "Tell me", "Name a", "Why do", "How many", "Say"]
        prompts = [tok(f"{words[i % len(words)]} {i}", add_special_tokens=False)["input_ids"] for i in range(args.prompts)]
        rows = [p for p in prompts for _ in range(args.num_generations)]
        row: dict[str, Any] = {"model": str(path.name), "params": sum(p.numel() for p in model.parameters())}
        row["hf"] = rollout_rate(HFEngine(tok), model, rows, params, args.repeats)
        vllm = VLLMEngine(tok, VLLMConfig(), max(len(p) for p in prompts) + args.max_new_tokens)
        start = time.perf_counter()
        vllm.sync_weights(model)  # builds the engine and pushes the weights
        row["vllm_start_s"] = round(time.perf_counter() - start, 1)
        row["vllm"] = rollout_rate(vllm, model, rows, params, args.repeats)
        row["vllm_over_hf"] = round(row["vllm"]["tokens_per_s"] / row["hf"]["tokens_per_s"], 2)
        results.append(row)
        print(f"{row['model']:>10} ({row['params'] / 1e6:.1f}M params): hf {row['hf']['tokens_per_s']:>8} tok/s | "
              f"vllm {row['vllm']['tokens_per_s']:>8} tok/s (x{row['vllm_over_hf']}; engine start {row['vllm_start_s']} s)",
              flush=True)
    meta = {"device": args.device, "dtype": args.dtype, "prompts": args.prompts, "num_generations": args.num_generations,
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version()}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":  # vLLM's workers spawn: the guard keeps them from re-running the benchmark
    main()
