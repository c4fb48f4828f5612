"""Rollout generation through the ``hf`` engine: the default dynamic KV cache vs the static cache
(``hf_generate.static_cache``) vs the static cache with a compiled decode step (``+ compile_decode``).

The shape of a GRPO iteration: ``--prompts`` prompts x ``--generations`` completions in ONE batch (issue 49's GPU
iteration: 8 x 8 = 64 completions x 48 tokens), sampled at temperature 1 through the engine's own sampler, the
same seed for every variant. The model: ``--model PATH`` (a local HF checkpoint; on the GPU machine the workload's
model) or, without one, the repo's ``tiny`` Llama built in a temporary folder. Each variant runs ``--warmup``
untimed calls (the compiled one compiles there; its compile seconds are reported apart) and ``--timed`` timed ones;
reported: samples/s and new tokens/s (median over the timed calls), the speed-up over the default, and whether
its samples equal the default's (they must: exact path). Usage::

    python benchmarks/bench_generate.py [--model PATH] [--device cpu|cuda] [--dtype fp32|bf16]
        [--prompts 8 --generations 8 --max-new 48] [--warmup 1 --timed 3] [--variants default,static,compiled]
        [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from alignkit.rollout.engine import HFEngine, HFGenerateConfig, SamplingParams

VARIANTS = {"default": HFGenerateConfig(), "static": HFGenerateConfig(static_cache=True),
            "compiled": HFGenerateConfig(static_cache=True, compile_decode=True)}


def load(model_path: str | None, device: str, dtype: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_path is None:
        from alignkit.models.tiny import build_tiny_model

        model_path = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", size="tiny", seed=0))
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_path)


def prompts(tok: Any, n: int, g: int) -> list[list[int]]:
    """``n`` arithmetic prompts of different lengths, each repeated ``g`` times (a GRPO group)."""
    texts = [f"Question {i}: what is {i} plus {i * 7 % 10}? " + "Think. " * (i % 4) for i in range(n)]
    return [ids for ids in tok(texts, add_special_tokens=False)["input_ids"] for _ in range(g)]


def run_variant(model: Any, tok: Any, ids: list[list[int]], settings: HFGenerateConfig, params: SamplingParams,
                warmup: int, timed: int, device: str) -> dict[str, Any]:
    engine = HFEngine(tok, settings)

    def once() -> tuple[float, list[list[int]]]:
        torch.manual_seed(0)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(model, ids, params).completion_ids
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    first = time.perf_counter()
    samples: list[list[int]] = []
    for _ in range(warmup):
        _, samples = once()
    warm_s = time.perf_counter() - first
    times = []
    for _ in range(timed):
        dt, samples = once()
        times.append(dt)
    median = statistics.median(times)
    tokens = sum(len(s) for s in samples)
    return {"seconds": median, "samples_per_s": len(ids) / median, "tokens_per_s": tokens / median,
            "warmup_s": warm_s, "times": times, "samples": samples}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timed", type=int, default=3)
    ap.add_argument("--variants", default="default,static,compiled")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load(args.model, args.device, args.dtype)
    ids = prompts(tok, args.prompts, args.generations)
    params = SamplingParams(args.max_new, 1.0, batch_size=len(ids))  # every prompt x generation in one batch
    rows: dict[str, dict[str, Any]] = {}
    for name in args.variants.split(","):
        rows[name] = run_variant(model, tok, ids, VARIANTS[name], params, args.warmup, args.timed, args.device)
    base = rows.get("default")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"device": device, "torch": torch.__version__, "model": args.model or "tiny (random)",
              "dtype": args.dtype, "batch": len(ids), "max_new_tokens": args.max_new, "variants": {}}
    for name, row in rows.items():
        report["variants"][name] = {
            **{k: round(v, 4) for k, v in row.items() if k in ("seconds", "samples_per_s", "tokens_per_s", "warmup_s")},
            "speedup": round(base["seconds"] / row["seconds"], 3) if base else None,
            "same_samples_as_default": row["samples"] == base["samples"] if base else None}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
