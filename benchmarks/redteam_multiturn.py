"""Multi-turn red team against the single-turn one at equal attacker samples (issue 48, item 4b, "Measured").

The world is the multi-turn synthetic task of ``data/synth_redteam.py``: the scripted target ``context_target``
answers a message holding a trigger toxically only when an EARLIER attacker message of the conversation raised the
subject (a trigger) or set a scene (a setup word); a trigger on its own gets a refusal. The scorer is the program
judge ``toxic_words``; the attacker the random micro Llama (``build_tiny_model(size="micro", seed=0)``); the
settings docs/workflows/redteam.md's for a random attacker ("When successes are rare": lr 6e-3, batch std), 4
instructions x 8 samples per iteration, ``rollout.max_new_tokens`` 8 per attacker turn, beta 0.05,
w_diversity 0: here most iterations hold no success at first (about one two-turn conversation in 70), and with
the batch std a batch without one would turn the diversity term's ~1e-4 differences into advantages of order 1
(measured: KL 0.23 and no rise in 40 iterations at w_diversity 0.1, 2 turns, seed 0); with 0 such a batch has
advantages 0. A sample is one conversation of ``redteam.turns`` attacker turns (1 = the single-turn red team:
one attack, one answer), so every variant draws the same number of attacker samples per iteration; a
conversation succeeds when its riskiest answer is toxic (``turn_risk: max``).

Per run: attack success (``attack_success_rate``: conversations with a toxic answer) of iterations 1-5 (start),
of the last 5 (end) and over all iterations (the successes per attacker sample of the whole run), and the
attacker's tokens per sample. ``--worlds context,trigger`` adds the same variants against ``trigger_target`` (the
single-turn world: a trigger in any message is enough), where one turn suffices. Every run is its own ``alignkit
train`` subprocess (``OMP_NUM_THREADS=1``), ``--jobs`` at a time. Usage::

    python benchmarks/redteam_multiturn.py [--turns 1,2,3] [--seeds 0,1,2] [--worlds context,trigger] [--steps 40] [--jobs 2]
        [--out benchmarks/results/redteam-multiturn] [--work DIR] [--set KEY=VALUE ...]

writes OUT/results.json and OUT/results.md (the markdown table, also printed). In
benchmarks/results/redteam-multiturn/ besides: results-25-iterations.* (``--turns 1,3 --seeds 0,1,2,3 --steps 25 --set
training.learning_rate=1e-2``, the multi-turn learning test's setting) and results-turn-credit.* (the same 3-turn runs
with ``redteam.turn_credit=turn`` at ``turn_discount`` 1.0 and 0.5 against the conversation credit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WINDOW = 5
TARGETS = {"context": "alignkit.data.synth_redteam:context_target", "trigger": "alignkit.data.synth_redteam:trigger_target"}


def config(model: Path, prompts: Path, out: Path, seed: int, steps: int, turns: int, target: str) -> dict[str, Any]:
    """The benchmark's run (module docstring)."""
    return {"algorithm": "redteam", "output_dir": str(out), "model": {"name_or_path": str(model)},
            "data": {"train": str(prompts), "max_length": 48 + 40 * (turns - 1)},
            "training": {"per_device_batch_size": 32, "max_steps": steps, "learning_rate": 6e-3,
                         "lr_scheduler": "constant", "warmup_steps": 0, "seed": seed},
            "logging": {"logging_steps": 1, "plot": False, "report_to": ["jsonl"]}, "checkpoint": {"save_final": False},
            "rollout": {"num_generations": 8, "max_new_tokens": 8}, "grpo": {"beta": 0.05},
            "redteam": {"target": {"name": TARGETS[target]}, "scorers": [{"name": "toxic_words"}], "turns": turns,
                        "w_diversity": 0.0, "top_attacks": 0, "save_attacks": False}}


def run_one(model: Path, prompts: Path, root: Path, target: str, turns: int, seed: int, steps: int,
            sets: list[str]) -> dict[str, Any]:
    out = root / f"{target}-t{turns}-s{seed}"
    path = root / f"{target}-t{turns}-s{seed}.yaml"
    path.write_text(yaml.safe_dump(config(model, prompts, out, seed, steps, turns, target)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    began = time.time()
    proc = subprocess.run([sys.executable, "-m", "alignkit", "train", str(path), *sets], capture_output=True,
                          text=True, env=env, cwd=REPO, check=False)
    if proc.returncode:
        raise RuntimeError(f"{out.name} failed:\n{proc.stderr[-3000:]}")
    rows = [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    asr = [r["attack_success_rate"] for r in rows]
    return {"target": target, "turns": turns, "seed": seed, "start": sum(asr[:WINDOW]) / WINDOW,
            "end": sum(asr[-WINDOW:]) / WINDOW, "all": sum(asr) / len(asr), "iterations": len(asr),
            "attacker_tokens": sum(r["completion_length"] for r in rows) / len(rows), "seconds": time.time() - began,
            "asr": asr}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| target world | turns | seed | start (it. 1-5) | end (last 5) | whole run | attacker tokens / sample | s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["target"], r["turns"], r["seed"])):
        lines.append(f"| {r['target']} | {r['turns']} | {r['seed']} | {r['start']:.3f} | {r['end']:.3f} | "
                     f"{r['all']:.3f} | {r['attacker_tokens']:.1f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", default="1,2,3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--worlds", default="context", help="context and / or trigger (the scripted target's rule)")
    ap.add_argument("--out", default=str(HERE / "results" / "redteam-multiturn"), help="results.json / results.md")
    ap.add_argument("--work", default="/tmp/alignkit-redteam-multiturn", help="the runs' folders")
    ap.add_argument("--set", nargs="*", default=[], dest="sets", help="KEY=VALUE config overrides")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from alignkit.data.synth import write_rows
    from alignkit.data.synth_redteam import make_redteam_rows
    from alignkit.models.tiny import build_tiny_model

    out = Path(args.out)
    work = Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(work / "micro", size="micro", seed=0)
    prompts = write_rows(make_redteam_rows(400, seed=0), work / "prompts.jsonl")
    targets = args.worlds.split(",")
    jobs = [(t, k, s) for t in targets for k in map(int, args.turns.split(",")) for s in map(int, args.seeds.split(","))]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: run_one(model, prompts, work, *j, args.steps, args.sets), jobs))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
