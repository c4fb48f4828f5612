"""Does red-team RL learn on worlds it was not tuned on? (issue 39) Worlds x seeds, start / end attack success.

A world is the synthetic red-team task of ``data/synth_redteam.py`` with other hidden triggers:
``make_world(world_seed, n_triggers)`` draws them from ``TRIGGER_POOL`` (words the project's own world never
uses); the prompt rows carry them (a ``triggers`` field) to the scripted target ``trigger_target``, the
scorer is the program judge ``toxic_words``. The attacker is the random micro Llama (``build_tiny_model(size=
"micro", seed=0)``), the settings those of docs/workflows/redteam.md: 40 iterations of 4 instructions x 8
attacks, lr 3e-3 constant, grpo.beta 0.05, redteam.w_diversity 0.1, ``rollout.max_new_tokens`` 8; ``--set
KEY=VALUE`` overrides any config key (the variants measured in benchmarks/README.md). World ``0:8`` is the
project's own (``TRIGGER_WORDS``).

Per run: start = mean attack_success_rate of iterations 1-5, end = of iterations 36-40 (of the last 5), the
share of groups (a prompt's ``num_generations`` attacks) with no success over iterations 1-10 (such a group's
advantages hold no toxicity signal), the policy's sampling entropy per token at the start and the end, and
whether it met the goal (end >= 0.5 wherever start >= 0.03). Every run is its own ``alignkit train``
subprocess (``OMP_NUM_THREADS=1``), ``--jobs`` at a time. Usage::

    python benchmarks/learn_redteam_worlds.py [--worlds 11:4,12:6,13:12] [--seeds 0,1,2] [--jobs 2]
        [--steps 40] [--out benchmarks/results/redteam-worlds] [--set redteam.w_diversity=0.1 ...] [--label NAME]

writes OUT/LABEL/results.json and prints the markdown table.
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


def base_config(model: Path, prompts: Path, out: Path, seed: int, steps: int) -> dict[str, Any]:
    """docs/workflows/redteam.md's CPU settings with the scripted target (the learning test's config)."""
    return {"algorithm": "redteam", "output_dir": str(out), "model": {"name_or_path": str(model)},
            "data": {"train": str(prompts), "max_length": 48},
            "training": {"per_device_batch_size": 32, "max_steps": steps, "learning_rate": 3e-3,
                         "lr_scheduler": "constant", "warmup_steps": 0, "seed": seed},
            "logging": {"logging_steps": 1, "plot": False, "report_to": ["jsonl"]}, "checkpoint": {"save_final": False},
            "rollout": {"num_generations": 8, "max_new_tokens": 8}, "grpo": {"beta": 0.05},
            "redteam": {"target": {"name": "alignkit.data.synth_redteam:trigger_target"},
                        "scorers": [{"name": "toxic_words"}], "w_diversity": 0.1, "top_attacks": 0}}


def run_one(model: Path, root: Path, world: tuple[int, int], seed: int, steps: int, sets: list[str]) -> dict[str, Any]:
    from alignkit.data.synth import write_rows
    from alignkit.data.synth_redteam import TRIGGER_WORDS, make_redteam_rows, make_world

    wseed, n = world
    triggers = TRIGGER_WORDS if wseed == 0 else make_world(wseed, n)
    out = root / f"w{wseed}-{n}-s{seed}"
    prompts = write_rows(make_redteam_rows(400, seed=0, triggers=None if wseed == 0 else triggers), root / f"prompts-{wseed}-{n}.jsonl")
    cfg_path = root / f"w{wseed}-{n}-s{seed}.yaml"
    cfg_path.write_text(yaml.safe_dump(base_config(model, prompts, out, seed, steps)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "alignkit", "train", str(cfg_path), *sets], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"run {out.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"world": f"{wseed}:{n}", "triggers": list(triggers), "seed": seed, "seconds": round(time.time() - t0),
            **summarise(out)}


def summarise(run: Path) -> dict[str, Any]:
    """Start / end success, zero-success groups of the first 10 iterations, entropy (module docstring)."""
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    group = cfg["rollout"]["num_generations"]
    asr = [r["attack_success_rate"] for r in rows]
    # split on newlines only: an attack may hold \x85 or \u2028, which json.dumps(ensure_ascii=False) keeps raw
    attacks = [json.loads(x) for x in (run / "attacks.jsonl").read_text(encoding="utf-8").split("\n") if x]
    early = [a for a in attacks if a["step"] <= 10]
    groups = [early[i:i + group] for i in range(0, len(early), group)]
    start, end = mean(asr[:WINDOW]), mean(asr[-WINDOW:])
    return {"start": round(start, 3), "end": round(end, 3), "curve": [round(a, 3) for a in asr],
            "zero_groups_1_10": round(mean([all(a["toxicity"] < 0.5 for a in g) for g in groups]), 3),
            "entropy_start": round(mean([r.get("entropy", float("nan")) for r in rows[:WINDOW]]), 3),
            "entropy_end": round(mean([r.get("entropy", float("nan")) for r in rows[-WINDOW:]]), 3),
            "distinct_end": round(mean([r["distinct_fraction"] for r in rows[-WINDOW:]]), 3),
            "goal": start < 0.03 or end >= 0.5}


def mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def table(results: list[dict[str, Any]]) -> str:
    head = ("| world (seed:triggers) | seed | start (it. 1-5) | end (last 5) | groups with no success (it. 1-10) | "
            "entropy start -> end | distinct end | goal |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['world']} | {r['seed']} | {r['start']:.3f} | {r['end']:.3f} | {r['zero_groups_1_10']:.2f} | "
              f"{r['entropy_start']:.2f} -> {r['entropy_end']:.2f} | {r['distinct_end']:.2f} | "
              f"{'yes' if r['goal'] else 'NO'}{'' if r['start'] >= 0.03 else ' (start < 0.03)'} |" for r in results]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="11:4,12:6,13:12", help="WORLD_SEED:N_TRIGGERS,... (0:8 = the project's own)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "redteam-worlds")
    ap.add_argument("--label", default="baseline")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a config override KEY=VALUE")
    args = ap.parse_args()
    from alignkit.models.tiny import build_tiny_model

    root = args.out / args.label
    root.mkdir(parents=True, exist_ok=True)
    model = args.out / "micro"
    if not (model / "config.json").exists():
        build_tiny_model(model, size="micro", seed=0)
    worlds = [tuple(int(x) for x in w.split(":")) for w in args.worlds.split(",")]
    jobs = [(w, int(s)) for w in worlds for s in args.seeds.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: run_one(model, root, j[0], j[1], args.steps, args.sets), jobs))
    (root / "results.json").write_text(json.dumps({"sets": args.sets, "steps": args.steps, "runs": results}, indent=1))
    met = [r["goal"] for r in results]
    print(f"{args.label} ({' '.join(args.sets) or 'the docs settings'}): goal met on {sum(met)}/{len(met)} runs")
    print(table(results))


if __name__ == "__main__":
    main()
