"""Do the shipped recipes still log the same numbers? Runs every ``configs/*.yaml`` for a few steps on CPU with
tiny models and the builtin / synthesised data, collects each run's ``metrics.jsonl`` without its timing keys, and
writes ``{config: [rows]}``; ``--compare A B`` says per config whether two such files agree (exit 1 if not).

    python benchmarks/recipe_identity.py --out before.json               # this tree
    python benchmarks/recipe_identity.py --root /path/to/other/tree --out after.json
    python benchmarks/recipe_identity.py --compare before.json after.json
    python benchmarks/recipe_identity.py --only sft dpo --out some.json  # a subset (and what they start from)

Only the CLI of the tree under test is called (``python -m alignkit`` with ``PYTHONPATH=ROOT/src``), never its
modules, so one script measures a tree before and after its modules move. The tiny scorers (text classifiers, CLIP)
come from the tree's ``tests/plugins/redteam_parts.py``, which uses transformers alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# one fixed folder: flow_sft (and flow_grpo after it) seeds each row's noise by the row's place, its data file's
# path and line, so runs in different folders draw different noise
DEFAULT_WORK = Path(tempfile.gettempdir()).resolve() / "alignkit-recipe-identity"
STEPS = 3
TOX_LABELS = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]
# timing, speed and memory keys: these may differ between runs of the same tree
# (case-sensitive: safe_dpo's loss_S / accuracy_S are numbers, rollout_s / time/update_s seconds)
TIMING = re.compile(r"(^|[/_])(time|times|seconds|secs|elapsed|eta|mfu|throughput)([/_]|$)"
                    r"|_s($|/)|_per_s|mem|_mb($|/)|_gb($|/)|rss")

COMMON = [f"training.max_steps={STEPS}", f"training.eval_steps={STEPS}", "training.seed=0", "logging.logging_steps=1",
          "logging.report_to=[jsonl]", "logging.plot=false", "checkpoint.save_steps=null", "distributed.strategy=single"]
ONLINE = ["rollout.num_generations=4", "rollout.max_new_tokens=6", "training.per_device_batch_size=8",
          "data.max_length=64"]
REDTEAM = [*ONLINE, "data.train={w}/prompts.jsonl", "data.eval={w}/prompts_eval.jsonl", "redteam.target.max_new_tokens=6"]
FLOW = ["flow_grpo.resolution=32", "flow_grpo.num_inference_steps=3", "flow_grpo.eval_num_inference_steps=3",
        "flow_grpo.guidance_scale=1.0", "flow_grpo.max_sequence_length=32"]
VLM = ["data.image_root={w}/shapes", "training.global_batch_size=4"]

# config -> (the configs whose outputs it starts from, its overrides); {w}: the work folder, {r}: the runs folder.
RECIPES: dict[str, tuple[list[str], list[str]]] = {
    "sft": ([], ["model.name_or_path={w}/lm", "training.per_device_batch_size=4"]),
    "sft_digits": ([], ["model.name_or_path={w}/lm", "training.per_device_batch_size=8"]),
    "dpo": ([], ["model.name_or_path={w}/lm", "training.per_device_batch_size=2"]),
    "dpo_lora": ([], ["model.name_or_path={w}/lm", "training.per_device_batch_size=2"]),
    "kto": ([], ["model.name_or_path={w}/lm", "training.per_device_batch_size=2"]),
    "orpo": ([], ["model.name_or_path={w}/lm", "training.per_device_batch_size=2"]),
    "rm_helpful": ([], ["model.name_or_path={w}/lm", "training.per_device_batch_size=4", "checkpoint.save_final=true"]),
    "rm_harmless": ([], ["model.name_or_path={w}/lm", "training.per_device_batch_size=4", "checkpoint.save_final=true"]),
    "safe_dpo": (["rm_helpful", "rm_harmless"], [
        "model.name_or_path={w}/lm", "safe_dpo.helpful_model={r}/rm_helpful/final",
        "safe_dpo.cost_model={r}/rm_harmless/final", "training.per_device_batch_size=2",
        "training.gradient_accumulation_steps=1", "safe_dpo.cost_eval_every=2", "safe_dpo.cost_eval_prompts=4",
        "data.max_length=96"]),
    "safe_dpo_lora": (["rm_helpful", "rm_harmless"], [
        "model.name_or_path={w}/lm", "safe_dpo.helpful_model={r}/rm_helpful/final",
        "safe_dpo.cost_model={r}/rm_harmless/final", "training.per_device_batch_size=2",
        "training.gradient_accumulation_steps=1", "safe_dpo.cost_eval_every=2", "safe_dpo.cost_eval_prompts=4",
        "data.max_length=96"]),
    "grpo": (["sft_digits"], ["model.name_or_path={r}/sft_digits/final", *ONLINE]),
    "sft_calculator": ([], ["model.name_or_path={w}/lm", "training.per_device_batch_size=8"]),
    "grpo_agent_calculator": (["sft_calculator"], ["model.name_or_path={r}/sft_calculator/final", *ONLINE,
                                                   "agent.max_total_tokens=24", "agent.max_turns=2",
                                                   "data.max_length=96"]),
    "ppo": (["sft_digits"], ["model.name_or_path={r}/sft_digits/final", *ONLINE]),
    "distill": (["sft_digits", "grpo"], ["model.name_or_path={r}/sft_digits/final", "distill.teacher={r}/grpo/final",
                                         *ONLINE]),
    "ppo_lag": (["sft_digits"], ["model.name_or_path={r}/sft_digits/final", *ONLINE]),
    "ppo_lag_rm": (["sft", "rm_helpful", "rm_harmless"], [
        "model.name_or_path={r}/sft/final", "data.train={w}/prompts.jsonl", "reward.model={r}/rm_helpful/final",
        "ppo_lag.cost_model={r}/rm_harmless/final", *ONLINE]),
    "redteam": ([], [
        "model.name_or_path={w}/lm", *REDTEAM, "redteam.target.model={w}/lm",
        "redteam.scorers=[{{name: toxicity, model: '{w}/tox'}}]"]),
    "redteam_multiturn": ([], [
        "model.name_or_path={w}/lm", *REDTEAM, "data.max_length=160", "redteam.target.model={w}/lm",
        "redteam.scorers=[{{name: toxicity, model: '{w}/tox'}}]"]),
    "flow_sft": ([], ["model.name_or_path={w}/sd3", "data.train={w}/shapes/captions.json",
                      "data.image_root={w}/shapes", "training.global_batch_size=4", "flow_sft.max_sequence_length=32"]),
    "flow_grpo": (["flow_sft"], [
        "model.name_or_path={r}/flow_sft/final", "data.train={w}/shapes/captions.json", *FLOW,
        "rollout.num_generations=2", "training.global_batch_size=4", "training.per_device_batch_size=4"]),
    "flow_rtpo": ([], [
        "model.name_or_path={w}/lm", *REDTEAM, "flow_rtpo.image_model={w}/sd3", "redteam.target.model={w}/llava",
        "rollout.num_generations=2", "training.per_device_batch_size=4", "flow_rtpo.images_per_attack=1",
        "flow_rtpo.image_learning_rate=1e-3",
        "redteam.scorers=[{{name: toxicity, model: '{w}/tox'}}, {{name: clip_quality, use: quality, model: '{w}/clip'}}]",
        *FLOW]),
    "vlm_pretrain": ([], ["model.name_or_path={w}/llava", "data.train={w}/shapes/pretrain.json", *VLM]),
    "vlm_sft": (["vlm_pretrain"], [
        "model.name_or_path={w}/llava", "vlm.projector_from={r}/vlm_pretrain/final",
        "data.train=[{w}/shapes/sft.json]", "data.eval={w}/shapes/eval.json", *VLM]),
}
SAVES_FINAL = ["checkpoint.save_final=true"]


def child_env(root: Path) -> dict[str, str]:
    """The tree's sources first; one thread everywhere so the float sums are the same from run to run."""
    env = dict(os.environ, PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    env.pop("ALIGNKIT_CONFIG", None)
    return env


def alignkit(root: Path, args: list[str], log: Path) -> float:
    """``python -m alignkit ARGS`` in ``root`` (its output into ``log``); raises with the log's tail on failure."""
    t0 = time.perf_counter()
    with log.open("w") as fh:
        rc = subprocess.run([sys.executable, "-m", "alignkit", *args], check=False, cwd=root, env=child_env(root),
                            stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"alignkit {' '.join(args[:2])} failed ({rc}); {log}:\n{tail}")
    return time.perf_counter() - t0


PARTS = ("lm", "llava", "sd3", "shapes", "prompts", "tox", "clip")


def parts_used(names: list[str]) -> set[str]:
    """The parts (``{w}/PART`` in their overrides) that ``names`` start from, with what those are built from (the
    toxicity classifier from the Llama, the CLIP scorer from the LLaVA's tower)."""
    text = " ".join(a for n in names for a in RECIPES[n][1])
    used = {p for p in PARTS if "{w}/" + p in text}
    return used | ({"lm"} if "tox" in used else set()) | ({"llava"} if "clip" in used else set())


def build_parts(root: Path, work: Path, used: set[str]) -> None:
    """The tiny models and data the recipes start from (``used``, of PARTS), built by the tree under test."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name, extra in (("lm", []), ("llava", ["--arch", "llava"]), ("sd3", ["--arch", "sd3", "--vae-steps", "0"])):
        if name in used:
            alignkit(root, ["tiny-model", str(work / name), "--size", "micro", "--seed", "0", *extra],
                     logs / f"{name}.log")
    shapes = work / "shapes"
    vlm = (("captions.json", ["--stage", "pretrain", "--split", "train", "--objects", "1", "--n", "16"]),
           ("pretrain.json", ["--stage", "pretrain", "--split", "train", "--n", "16"]),
           ("sft.json", ["--stage", "sft", "--split", "train", "--n", "16"]),
           ("eval.json", ["--stage", "sft", "--split", "eval", "--n", "4", "--seed", "1"]))
    for out, args in vlm if "shapes" in used else ():
        alignkit(root, ["data", "synth", "--kind", "vlm", *args, "--out", str(shapes / out)], logs / f"{out}.log")
    for out, n, seed in (("prompts.jsonl", 16, 0), ("prompts_eval.jsonl", 4, 1)) if "prompts" in used else ():
        alignkit(root, ["data", "synth", "--kind", "prompts", "--n", str(n), "--seed", str(seed), "--out",
                        str(work / out)], logs / f"{out}.log")
    code = ["import sys; from tests.plugins.redteam_parts import build_classifier, build_clip"]
    if "tox" in used:
        code.append(f"build_classifier(sys.argv[1], sys.argv[3], {TOX_LABELS!r}, multi_label=True)")
    if "clip" in used:
        code.append("build_clip(sys.argv[2], sys.argv[4])")
    if len(code) > 1:
        subprocess.run([sys.executable, "-c", "; ".join(code), str(work / "tox"), str(work / "clip"),
                        str(work / "lm"), str(work / "llava")], cwd=root, env=child_env(root), check=True,
                       capture_output=True)


def with_deps(names: list[str]) -> list[str]:
    """``names`` and the recipes they start from, each after what it needs, in RECIPES' order."""
    want: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in want:
            want.add(name)
            todo += RECIPES[name][0]
    return [n for n in RECIPES if n in want]


def untimed(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not TIMING.search(k)}


def run_recipes(root: Path, names: list[str], work: Path) -> tuple[dict[str, list[dict]], dict[str, float]]:
    build_parts(root, work, parts_used(names))
    runs, results, seconds = work / "runs", {}, {}
    needed = {d for n in names for d in RECIPES[n][0]}
    for name in names:
        overrides = RECIPES[name][1]
        out = runs / name
        args = [a.format(w=work, r=runs) for a in [*COMMON, *overrides, *(SAVES_FINAL if name in needed else [])]]
        seconds[name] = alignkit(root, ["train", str(root / "configs" / f"{name}.yaml"), f"output_dir={out}", *args],
                                 work / "logs" / f"{name}.log")
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        results[name] = [untimed(r) for r in rows]
        print(f"{name}: {len(rows)} rows in {seconds[name]:.1f}s", flush=True)
    return results, seconds


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    if len(a) != len(b):
        return f"{len(a)} rows vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        for key in sorted(set(x) | set(y)):
            if x.get(key, "<absent>") != y.get(key, "<absent>"):
                return f"row {i} (step {x.get('step')}) {key}: {x.get(key, '<absent>')!r} vs {y.get(key, '<absent>')!r}"
    return None


def differing_keys(a: list[dict], b: list[dict]) -> list[str]:
    keys = {k for x, y in zip(a, b) for k in set(x) | set(y) if x.get(k, "<absent>") != y.get(k, "<absent>")}
    return sorted(keys)


def compare(path_a: Path, path_b: Path) -> int:
    a, b = (json.loads(p.read_text())["recipes"] for p in (path_a, path_b))
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {path_a if name in a else path_b}")
            bad += 1
            continue
        diff = first_difference(a[name], b[name])
        if diff is None:
            print(f"{name}: identical ({len(a[name])} rows)")
        else:
            bad += 1
            print(f"{name}: DIFFERS in {', '.join(differing_keys(a[name], b[name])) or 'row count'}; first: {diff}")
    print(f"{len(set(a) | set(b)) - bad} identical, {bad} differing")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=REPO, help="the tree under test (its src/ and configs/)")
    p.add_argument("--out", type=Path, help="write {recipes: {config: [rows]}, seconds: ...} here")
    p.add_argument("--only", nargs="+", choices=sorted(RECIPES), metavar="NAME", help="these configs (and their upstream)")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK,
                   help=f"models, runs and logs (default {DEFAULT_WORK}, emptied first; another folder must be empty). "
                        "Compare runs made in the same folder: flow_sft seeds its noise by the data file's path")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two --out files")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    root = args.root.resolve()
    shipped = sorted(f.stem for f in (root / "configs").glob("*.yaml"))
    if set(shipped) != set(RECIPES):
        raise SystemExit(f"configs/*.yaml and RECIPES differ: {sorted(set(shipped) ^ set(RECIPES))}")
    work = args.work.resolve()
    if work == DEFAULT_WORK and work.exists():
        shutil.rmtree(work)
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"--work {work} is not empty")
    t0 = time.perf_counter()
    results, seconds = run_recipes(root, with_deps(args.only or list(RECIPES)), work)
    total = time.perf_counter() - t0
    print(f"{len(results)} recipes in {total:.0f}s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"root": str(root), "steps": STEPS, "recipes": results,
               "seconds": {"total": round(total, 1), **{k: round(v, 1) for k, v in seconds.items()}}}
        args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
