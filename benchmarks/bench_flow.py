"""Flow-GRPO: where a training iteration's time goes, against a plain diffusers pipeline call (the floor).

One ``alignkit train configs/flow_grpo.yaml`` run (LoRA, one process) logs per iteration ``sample_s`` (text
encoding + the SDE sampler with per-step log-probs + VAE decoding), ``rollout_s`` (that + scoring the images +
advantages) and ``update_s`` (the log-probs recomputed under the current policy at the stored latents, the
LoRA-off reference forward of the KL term, backward and the optimizer step, over every (image, step) pair).
The floor is ``StableDiffusion3Pipeline.__call__`` on the same pipeline for the same number of images, steps,
resolution and guidance (ODE sampling, no log-probs, no training). The first iteration is a warm-up, left out.

    python benchmarks/bench_flow.py                       # a tiny random SD3 pipeline, 32 px, 32 images x 6 steps
    python benchmarks/bench_flow.py --model runs/flow_sft/final --iterations 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_training(model: str, data: Path, out: Path, a: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, "-m", "alignkit", "train", str(REPO / "configs" / "flow_grpo.yaml"),
           f"model.name_or_path={model}", f"data.train={data}", f"output_dir={out}",
           f"training.max_steps={a.iterations + 1}", f"training.global_batch_size={a.images}",
           f"training.per_device_batch_size={a.images}", f"rollout.num_generations={a.group}",
           f"flow_grpo.num_inference_steps={a.steps}", f"flow_grpo.resolution={a.resolution}",
           f"flow_grpo.guidance_scale={a.guidance}", "checkpoint.save_steps=null", "checkpoint.save_final=false",
           "rollout.mini_batches=1",  # one optimizer step per iteration: max_steps counts iterations, as measured
           "logging.report_to=[jsonl]", "logging.plot=false", "distributed.strategy=single"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"training failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "update_s" in r][1:]


def time_pipeline(model: str, prompts: list[str], a: argparse.Namespace) -> list[float]:
    import torch
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    times = []
    for i in range(a.iterations + 1):
        start = time.perf_counter()
        with torch.no_grad():
            pipe(prompt=prompts, num_inference_steps=a.steps, guidance_scale=a.guidance, height=a.resolution,
                 width=a.resolution, max_sequence_length=32, generator=torch.Generator().manual_seed(i))
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a diffusers SD3 pipeline (default: a tiny random one is built)")
    p.add_argument("--images", type=int, default=32, help="images per iteration")
    p.add_argument("--group", type=int, default=8, help="images per prompt")
    p.add_argument("--steps", type=int, default=6, help="denoising steps")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--guidance", type=float, default=1.0)
    p.add_argument("--iterations", type=int, default=5, help="timed iterations (after one warm-up)")
    a = p.parse_args()
    from alignkit.data.synth_vlm import generate_vlm

    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from alignkit.models.tiny_sd3 import build_tiny_sd3

            model = str(build_tiny_sd3(Path(tmp) / "sd3", size="tiny", seed=0))
        data = generate_vlm(4 * a.images, 0, Path(tmp) / "captions.json", stage="pretrain", split="train")
        rows = run_training(model, data, Path(tmp) / "run", a)
        prompts = [r["conversations"][-1]["value"] for r in json.loads(data.read_text())][: a.images]
        floor = time_pipeline(model, prompts, a)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    sample = med([r["sample_s"] for r in rows])
    score = med([r["rollout_s"] - r["sample_s"] for r in rows])
    update = med([r["update_s"] for r in rows])
    total, pipe = sample + score + update, med(floor)
    print(f"{a.images} images x {a.steps} steps, {a.resolution} px, guidance {a.guidance}, median of {a.iterations}"
          f" iterations (torch threads {os.environ.get('OMP_NUM_THREADS', 'default')})\n")
    print("| phase | s / iteration | share | x pipeline call |\n|---|---|---|---|")
    for name, v in (("sampling (SDE + log-probs + decode)", sample), ("scoring + advantages", score),
                    ("update (log-prob recompute, KL ref, backward, step)", update), ("iteration", total)):
        print(f"| {name} | {v:.3f} | {v / total:.0%} | {v / pipe:.2f} |")
    print(f"| diffusers pipeline call (floor) | {pipe:.3f} | | 1.00 |")


if __name__ == "__main__":
    main()
