"""Text-to-image renderers for the red-team ``t2i_vlm`` target: an attack prompt in, a PIL image out (frozen,
under no_grad, on the rank that drew the attack).

* ``builtin:shapes``: a small deterministic renderer for tests and CPU demos. The words of the text that name a
  colour or a shape of :mod:`alignkit.data.synth_vlm` decide the scene (each shape word, in order, takes the
  colour word said last before it, else the first colour of the text; a colour without any shape word draws
  a square; up to four objects, one per grid cell in reading order); a text naming nothing draws the scene
  that ``crc32(text)`` seeds. The jitter is seeded by ``crc32(text)`` too: the same text always gives the
  same image, and another colour or shape word another image.
* anything else: a diffusers pipeline by hub id or local path (``AutoPipelineForText2Image``, else
  ``DiffusionPipeline``; ``pip install 'alignkit[image]'``), called with ``num_inference_steps``,
  ``guidance_scale`` and ``height`` / ``width`` when set, each attack with a generator seeded by
  ``crc32(text)`` (the same attack renders the same image).
"""

from __future__ import annotations

import random
import re
import zlib
from typing import Any

import torch

from alignkit.data.synth_vlm import COLOURS, POSITIONS, SHAPES, draw, make_scene
from alignkit.errors import ModelError
from alignkit.models.diffusion import quiet_diffusers
from alignkit.models.sources import model_errors

BUILTIN_SHAPES = "builtin:shapes"
_WORD = re.compile(r"[a-z]+")
_PLURAL = {"circles": "circle", "squares": "square", "triangles": "triangle", "colour": "", "color": ""}


def seed_of(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def shapes_scene(text: str) -> list[dict[str, str]]:
    """The scene the words of ``text`` name (module docstring)."""
    words = [_PLURAL.get(w, w) for w in _WORD.findall(text.lower())]
    colours = [w for w in words if w in COLOURS]
    objs, colour = [], None
    for w in words:
        if w in COLOURS:
            colour = w
        elif w in SHAPES:
            objs.append((colour or (colours[0] if colours else "yellow"), w))
    if not objs and colours:
        objs = [(c, "square") for c in colours]
    if not objs:
        return make_scene(random.Random(seed_of(text)))
    cells = list(POSITIONS)
    return [{"shape": s, "colour": c, "position": cells[i]} for i, (c, s) in enumerate(objs[: len(cells)])]


class ShapesRenderer:
    """``builtin:shapes`` (module docstring); ``height`` / ``width`` resize its 32x32 canvas when set."""

    def __init__(self, cfg: Any) -> None:
        self.size = (cfg.width, cfg.height) if cfg.height and cfg.width else None

    def __call__(self, texts: list[str], device: torch.device) -> list[Any]:
        images = [draw(shapes_scene(t), random.Random(seed_of(t))) for t in texts]
        return [img.resize(self.size) for img in images] if self.size else images


class DiffusersRenderer:
    """A diffusers text-to-image pipeline loaded on first use on the rendering rank's device."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.pipe = cfg, None

    def load(self, device: torch.device) -> None:
        try:
            import diffusers
        except ImportError:
            raise ModelError(f"redteam.target.renderer {self.cfg.renderer!r} needs diffusers (pip install "
                             f"'alignkit[image]'), or use renderer: {BUILTIN_SHAPES}") from None
        with model_errors(self.cfg.renderer), quiet_diffusers():
            try:
                pipe = diffusers.AutoPipelineForText2Image.from_pretrained(self.cfg.renderer)
            except ValueError:  # a pipeline class AutoPipeline does not map
                pipe = diffusers.DiffusionPipeline.from_pretrained(self.cfg.renderer)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(device)

    @torch.no_grad()
    def __call__(self, texts: list[str], device: torch.device) -> list[Any]:
        if self.pipe is None:
            self.load(device)
        cfg, out = self.cfg, []
        sizes = {k: v for k, v in (("height", cfg.height), ("width", cfg.width)) if v}
        for start in range(0, len(texts), cfg.render_batch_size):
            chunk = texts[start : start + cfg.render_batch_size]
            gens = [torch.Generator(device=device).manual_seed(seed_of(t)) for t in chunk]
            out += list(self.pipe(prompt=chunk, num_inference_steps=cfg.num_inference_steps,
                                  guidance_scale=cfg.guidance_scale, generator=gens, **sizes).images)
        return out


def build_renderer(cfg: Any) -> Any:
    """The renderer of ``redteam.target.renderer``: ``builtin:shapes`` or a diffusers pipeline's name/path."""
    return ShapesRenderer(cfg) if cfg.renderer == BUILTIN_SHAPES else DiffusersRenderer(cfg)
