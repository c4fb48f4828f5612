"""A user's image reward as ``module:function`` for ``flow_grpo.scorers`` (docs/workflows/flow-grpo.md, "Rewards"):
the mean brightness of each image, in [0, 1]. It refuses to score without images, so a run that handed it only the
prompts (as before issue 50) fails instead of training on nothing."""

from __future__ import annotations

from typing import Any

import numpy as np


def brightness(prompts: list[Any], completions: list[str], *, images: list[Any] | None = None,
               **_: Any) -> list[float]:
    """Each image's mean pixel value / 255 (RGB PIL images, one per prompt)."""
    if images is None or len(images) != len(prompts):
        raise ValueError(f"brightness scores images: got {None if images is None else len(images)} for "
                         f"{len(prompts)} prompts")
    return [float(np.asarray(im, dtype=np.float64).mean() / 255.0) for im in images]
