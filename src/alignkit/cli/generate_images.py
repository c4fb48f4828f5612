"""``alignkit generate`` for a text-to-image (diffusion) policy: images of a prompt file, one grid PNG per prompt.

The target is a run config of a diffusion policy (its ``OUTPUT_DIR/final``: a LoRA adapter on
``model.name_or_path``, or a whole pipeline; without one the start, said in one line; the ``flow_grpo`` section's
resolution, evaluation steps, guidance and T5 length are the defaults, ``--max-sequence-length`` sets the last), a
diffusers pipeline directory or hub id, or a LoRA directory with ``--base``.
Each prompt gets ``--num-generations`` images from the diffusion kind's deterministic ODE sampler (its ``generate``:
``models/diffusion_sample.py``, the same path as Flow-GRPO's evaluation), image g of prompt i seeded by (``--seed``, i, g): the same command draws the
same images, so grids before and after training compare. ``--out`` is a folder: ``prompt-0000.png`` ... (the
group side by side) and ``images.jsonl`` (each input row + its grid + with ``--reward`` a scorer of the red-team
registry, e.g. shapes_colour, its scores).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections)
from alignkit.algorithms.flow_grpo import FlowGRPOConfig
from alignkit.algorithms.flow_sft import seeded
from alignkit.algorithms.redteam import RedTeamScorerConfig
from alignkit.config import load_config
from alignkit.config.sections import ALGORITHMS
from alignkit.data.captions import caption_of
from alignkit.data.io import read_rows
from alignkit.errors import ConfigError
from alignkit.models.diffusion import LORA_WEIGHTS, FlowPolicy, load_pipeline, quiet_diffusers
from alignkit.models.diffusion_sample import FlowSampling, ImagePrompt
from alignkit.models.kinds import KINDS
from alignkit.rewards.scorers import Judged, build_scorer


@dataclass
class ImageTarget:
    base: str
    lora: str | None = None
    resolution: int = 512
    steps: int = 28
    guidance: float = 4.5
    max_sequence_length: int = 77


def is_diffusion_target(target: str, base: str | None) -> bool:
    """Whether ``alignkit generate``'s target is a text-to-image policy (a config of one, a pipeline, a LoRA)."""
    path = Path(target)
    if target.endswith((".yaml", ".yml")):
        cfg = load_config(target, [], notes=False)
        return cfg.model.kind == "diffusion" or any(
            s.kind == "diffusion" for s in ALGORITHMS.get(cfg.algorithm).model_specs(cfg))
    return (path / "model_index.json").is_file() or (path / LORA_WEIGHTS).is_file() or base is not None


def resolve_target(target: str, base: str | None) -> ImageTarget:
    if target.endswith((".yaml", ".yml")):
        cfg = load_config(target, [], notes=False)
        base, final = image_policy_of(cfg)
        o = cfg.section(FlowGRPOConfig)
        out = ImageTarget(base, resolution=o.resolution, steps=o.eval_num_inference_steps,
                          guidance=o.guidance_scale, max_sequence_length=o.max_sequence_length)
        if (final / LORA_WEIGHTS).is_file():
            out.lora = str(final)
        elif (final / "model_index.json").is_file():
            out.base = str(final)
        else:
            say_no_final(final, base)
        return out
    if (Path(target) / LORA_WEIGHTS).is_file() and not (Path(target) / "model_index.json").is_file():
        if base is None:
            raise ConfigError(f"{target}: a LoRA adapter alone; name its pipeline with --base")
        return ImageTarget(base, lora=target)
    return ImageTarget(target)


def say_no_final(final: Path, start: str) -> None:
    """The one line of a run config whose trained model is not there: what ``generate`` draws instead."""
    print(f"alignkit generate: {final} holds no trained model (the run has not finished, or saved none): drawing "
          f"the run's start, {start}", file=sys.stderr)


def image_policy_of(cfg: Any) -> tuple[str, Path]:
    """The trained diffusion role of ``cfg``'s run: its start (pipeline or hub id) and its final folder (``final``
    for the run's first trained role, ``final_ROLE`` for another: flow_rtpo's image policy next to its attacker)."""
    trained = [s for s in ALGORITHMS.get(cfg.algorithm).model_specs(cfg) if s.trainable]
    spec = next((s for s in trained if s.kind == "diffusion"), None)
    if spec is None:
        return cfg.model.name_or_path, Path(cfg.output_dir) / "final"
    return spec.source, Path(cfg.output_dir) / ("final" if spec is trained[0] else f"final_{spec.role}")


def generate_images(args: argparse.Namespace) -> int:
    if not args.out:
        raise ConfigError("alignkit generate: a text-to-image policy writes images: give --out FOLDER")
    t = resolve_target(args.target, args.base)
    steps, n = args.num_inference_steps or t.steps, args.num_generations
    guidance = t.guidance if args.guidance_scale is None else args.guidance_scale
    resolution = args.resolution or t.resolution
    pipe = load_pipeline(t.base, torch.float32)
    if t.lora:
        with quiet_diffusers():
            pipe.load_lora_weights(t.lora)
    flow = FlowPolicy(pipe, lora=False).eval()
    params = FlowSampling(steps, 0.0, guidance, resolution, args.max_sequence_length or t.max_sequence_length)
    rows = read_rows(args.file)
    prompts = [caption_of(r) for r in rows]
    scorer = _scorer(args.reward)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, scored = [], []
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        requests = [ImagePrompt(prompt, seeded(args.seed, i, f"generate:{g}")) for g in range(n)]
        images = KINDS.get("diffusion").generate(flow, None, requests, params).images  # no token engine
        grid = out / f"prompt-{i:04d}.png"
        image_grid(images).save(grid)
        rec: dict[str, Any] = {**row.data, "prompt": prompt, "grid": grid.name}
        if scorer is not None:
            rec["scores"] = _score(scorer, prompt, images)
            scored += [s for s in rec["scores"] if s == s]
        records.append(rec)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    (out / "images.jsonl").write_text(lines, encoding="utf-8")
    print(f"wrote {len(records)} grids of {n} images ({resolution} px, {steps} steps, guidance {guidance}, "
          f"{params.max_sequence_length} T5 tokens) to {out}")
    if scorer is not None:
        print(f"{args.reward}: mean {sum(scored) / max(1, len(scored)):.4f} over {len(scored)} images")
    return 0


def image_grid(images: list[Any]) -> Any:
    """The images side by side in one PIL image."""
    from PIL import Image

    w, h = images[0].size
    grid = Image.new("RGB", (w * len(images), h))
    for k, img in enumerate(images):
        grid.paste(img, (k * w, 0))
    return grid


def _scorer(name: str | None) -> Any:
    if name is None:
        return None
    return build_scorer(RedTeamScorerConfig(name=name), None)


def _score(scorer: Any, prompt: str, images: list[Any]) -> list[float]:
    n = len(images)
    values = scorer(Judged([prompt] * n, [""] * n, [prompt] * n, [{}] * n, images), torch.device("cpu"))
    return [float("nan") if v is None else float(v) for v in values]
