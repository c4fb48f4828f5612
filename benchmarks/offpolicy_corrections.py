#!/usr/bin/env python
"""Which ``off_policy.correction`` learns best when the samples come from a policy ``LAG`` iterations behind.

    python benchmarks/offpolicy_corrections.py --sft runs/sft-digits/final --lag 4 --seeds 0 1 --steps 40

Runs configs/grpo.yaml on the shipped digits task with ``algorithm: grpo_lagged`` (benchmarks/offpolicy_lag.py:
completions drawn by the policy of ``--lag`` iterations ago, its log-probs recorded as the behaviour log-probs) under
each correction, and the synchronous GRPO (lag 0, no weights) beside them; reports per run the mean reward of the
first and last 10 iterations and the mean share of tokens masked / changed by the cap. Writes a JSON to
benchmarks/results/. The thread count is fixed (OMP_NUM_THREADS=1) and recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORRECTIONS = ["none", "token_truncate", "token_mask", "sequence_truncate", "icepop", "sequence_geo_mask"]


def run(sft: str, out: Path, seed: int, steps: int, lag: int, correction: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OFFPOLICY_LAG": str(lag),
           "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    algo = ["algorithm=grpo_lagged", "plugins=[benchmarks.offpolicy_lag]"] if lag else []
    cmd = [sys.executable, "-m", "alignkit", "train", str(ROOT / "configs/grpo.yaml"), f"model.name_or_path={sft}",
           f"output_dir={out}", f"training.max_steps={steps}", f"training.seed={seed}", "data.eval=[]",
           "logging.plot=false", "logging.logging_steps=1", f"off_policy.correction={correction}",
           *algo]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_mean" in r]
    mean = lambda xs: sum(xs) / max(1, len(xs))
    return {"first10": mean([r["reward_mean"] for r in rows[:10]]), "last10": mean([r["reward_mean"] for r in rows[-10:]]),
            "masked": mean([r.get("sampler_is_masked", 0.0) for r in rows]),
            "capped": mean([r.get("sampler_is_capped", 0.0) for r in rows]),
            "ratio": mean([r.get("sampler_is_ratio", 1.0) for r in rows])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sft", required=True)
    p.add_argument("--lag", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--work", default="/tmp/offpolicy_runs")
    p.add_argument("--corrections", nargs="+", default=CORRECTIONS)
    a = p.parse_args()
    results = []
    for seed in a.seeds:
        for lag, correction in [(0, "none")] + [(a.lag, c) for c in a.corrections]:
            t = time.time()
            r = run(a.sft, Path(a.work) / f"lag{lag}-{correction}-s{seed}", seed, a.steps, lag, correction)
            results.append({"seed": seed, "lag": lag, "correction": correction, **r, "seconds": time.time() - t})
            print(json.dumps(results[-1]), flush=True)
    out = ROOT / "benchmarks/results" / f"offpolicy-corrections-lag{a.lag}.json"
    out.write_text(json.dumps({"threads": 1, "steps": a.steps, "runs": results}, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
