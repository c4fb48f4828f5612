#!/usr/bin/env python
"""A Safe-MM-DPO optimizer step vs a DPO step on the same rows and policy, and peak memory with and
without cached frozen scores.

    python benchmarks/bench_safe_dpo.py                       # tiny model, CPU or the local GPU
    python benchmarks/bench_safe_dpo.py --size micro --steps 10

Variants, each in its OWN subprocess (so peak memory is per variant):

* ``dpo``             DPO on the helpful pairs, reference log-probs cached (``dpo.precompute_ref_logps``);
* ``safe_cached``     safe_dpo (mm_dpo), reference log-probs and both frozen scores cached, no J_C estimate:
                      the step the issue's <= 1.3x target is about;
* ``safe_uncached``   safe_dpo with the reference and both frozen scorers run on every micro-batch;
* ``safe_cached_jc``  safe_cached plus the on-policy J_C estimate every 10 steps (16 prompts, 32 tokens).

Frozen scorers are the policy's backbone with a random score head (timing does not depend on what
they learned). Each child times ``--steps`` optimizer steps after 2 warm-up steps (forward, backward,
optimizer, the hook) and reports median seconds per step and peak memory (CUDA allocator peak on a
GPU, peak RSS on CPU). Prints a markdown table.

Measured on 2 shared CPU cores (other jobs running, so +-50% per row; no GPU was available):

    | variant (tiny, batch 4 rows, cpu) | s/step (median) | vs dpo | precompute s | peak MB |
    | dpo                               | 2.042           | 1.00x  | 13.2         | 563     |
    | safe_cached                       | 1.191           | 0.58x  | 30.7         | 563     |
    | safe_uncached                     | 5.260           | 2.58x  | 0.0          | 613     |
    | safe_cached_jc                    | 1.926           | 0.94x  | 33.4         | 576     |

With cached frozen scores a Safe-MM-DPO step costs a DPO step (same forwards: the policy over the 2B
responses once); without caching it runs the reference and both scorers per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "dpo": ("dpo", ["dpo.pair=helpful", "dpo.precompute_ref_logps=true"]),
    "safe_cached": ("safe_dpo", ["dpo.precompute_ref_logps=true", "safe_dpo.precompute_scores=true",
                                 "safe_dpo.cost_eval_every=0"]),
    "safe_uncached": ("safe_dpo", ["dpo.precompute_ref_logps=false", "safe_dpo.precompute_scores=false",
                                   "safe_dpo.cost_eval_every=0"]),
    "safe_cached_jc": ("safe_dpo", ["dpo.precompute_ref_logps=true", "safe_dpo.precompute_scores=true",
                                    "safe_dpo.cost_eval_every=10", "safe_dpo.cost_eval_prompts=16",
                                    "safe_dpo.cost_max_new_tokens=32"]),
}


def child(variant: str, model: str, helpful: str, cost: str, steps: int, batch: int) -> None:
    import torch

    from alignkit.algorithms import ALGORITHMS, workload_of
    from alignkit.algorithms.base import Context
    from alignkit.config import load_config
    from alignkit.distributed.env import read_env
    from alignkit.logging import peak_memory_mb
    from alignkit.models.loading import load_tokenizer
    from alignkit.train.runner import build_models, strategy_for
    from alignkit.train.optim import build_optimizer
    from alignkit.train.step import accumulate, optimizer_step

    algorithm, over = VARIANTS[variant]
    cfg = load_config(None, [f"algorithm={algorithm}", f"model.name_or_path={model}", "data.train=builtin:safety_train.jsonl",
                             "data.max_length=256", "data.chat_template=true", f"training.per_device_batch_size={batch}",
                             "training.learning_rate=1e-5", f"safe_dpo.helpful_model={helpful}",
                             f"safe_dpo.cost_model={cost}", "safe_dpo.sign_check_rows=0", *over])
    algo = ALGORITHMS.get(algorithm)(cfg, load_tokenizer(cfg.model))
    rows = algo.data.build_dataset(cfg.data.train, "train")[: batch * (steps + 2)]
    strategy = strategy_for(cfg, read_env())
    strategy.setup()
    if strategy.device.type == "cpu":  # as run_train does: subnormal floats are ~100x slower on x86
        torch.set_flush_denormal(True)
    models = build_models(workload_of(cfg), cfg.model, strategy, algo.tokenizer,
                          make_optimizer=lambda m: build_optimizer(m, cfg.training, 1e-5))
    start = time.perf_counter()
    algo.before_training(Context(models, strategy), rows, [])
    precompute = time.perf_counter() - start
    models.train()
    times = []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        group = [algo.data.collate(rows[step * batch : (step + 1) * batch])]
        losses, _, _ = accumulate(strategy, models, group, algo.loss, algo.data.loss_units, algo.data.tokens_in)
        optimizer_step(strategy, models, 1.0, losses)
        algo.on_step_end(Context(models, strategy, step + 1))
        if strategy.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print("BENCH_RESULT " + json.dumps({"variant": variant, "step_s": statistics.median(times[2:]), "times": times,
                                        "mean_step_s": statistics.mean(times[2:]), "precompute_s": precompute,
                                        "peak_mb": peak_memory_mb(strategy.device.type),
                                        "device": strategy.device.type}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from alignkit.models.tiny import build_tiny_model

    work = Path(args.out or tempfile.mkdtemp(prefix="bench_safe_dpo_"))
    model = build_tiny_model(work / "policy", size=args.size, seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    for name in ("helpful", "cost"):
        m = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
        m.config.pad_token_id = tok.pad_token_id
        m.save_pretrained(work / name)
        tok.save_pretrained(work / name)
    results = []
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--child", variant, str(model), str(work / "helpful"),
                               str(work / "cost"), str(args.steps), str(args.batch)], capture_output=True, text=True)
        line = next((s for s in proc.stdout.splitlines() if s.startswith("BENCH_RESULT ")), None)
        if line is None:
            sys.exit(f"{variant} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[len("BENCH_RESULT "):]))
    base = results[0]["step_s"]
    print(f"| variant ({args.size}, batch {args.batch} rows, {results[0]['device']}) | s/step (median) | vs dpo "
          "| precompute s | peak MB |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['step_s']:.3f} | {r['step_s'] / base:.2f}x | {r['precompute_s']:.1f} "
              f"| {r['peak_mb']:.0f} |")
    (work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7]))
    else:
        main()
