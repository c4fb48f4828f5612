"""Programmatic rewards of rendered images for the shipped shapes task (``alignkit.data.synth_vlm``).

``shapes_colour``: does the image put the colour the prompt asks for at the place it names? The prompt's objects
are read from its words (``a red circle in the top left and a blue square in the bottom right``: each
``<colour> <shape> in the <position>``). The image (resized to the task's 32x32 canvas) is split into the 2x2
grid of cells; each pixel takes the nearest colour of the task's palette (black background + its four
colours, RGB distance). A cell that should hold an object scores (pixels of the asked colour - pixels of the
other colours) / pixels of the cell; a cell that should be empty scores -(pixels of any colour) / pixels of
the cell. The reward is the mean over the four cells, in [-1, 1]: the drawn scenes themselves score about
0.3-0.6 (a shape fills part of its cell), noise about 0, and the wrong colour in the right place below 0.
Dense, so a policy that draws the colours but not yet the layout still gets a slope to climb.

``shapes_hit``: the share of the prompt's objects whose cell shows the asked colour: the most frequent colour of
the cell (background aside) and at least ``HIT_SHARE`` of its pixels. The yes/no reading of the same maps, to
see what a rise of ``shapes_colour`` means (a drawn scene scores 1, an empty or wrongly coloured cell 0).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from alignkit.data.synth_vlm import CANVAS, COLOURS, POSITIONS, SHAPES

_OBJECT = re.compile(r"\b(" + "|".join(COLOURS) + r")\s+(" + "|".join(SHAPES) + r")s?\s+in\s+the\s+("
                     + "|".join(POSITIONS) + r")\b")
_PALETTE = np.array([(0, 0, 0), *COLOURS.values()], dtype=np.float32)  # index 0: the background
_NAMES = ["black", *COLOURS]
CELL = CANVAS // 2
#: ``shapes_hit``: the least share of a cell the asked colour must cover (a drawn shape covers 0.3-0.6 of its cell)
HIT_SHARE = 0.1


def prompt_objects(text: str) -> list[dict[str, str]]:
    """The ``{colour, shape, position}`` objects a prompt names (module docstring); [] when it names none."""
    return [{"colour": c, "shape": s, "position": p} for c, s, p in _OBJECT.findall(text.lower())]


def palette_map(image: Any) -> np.ndarray:
    """``(32, 32)`` index of each pixel's nearest palette colour (0 = black) of a PIL image."""
    from PIL import Image

    img = image.convert("RGB")
    if img.size != (CANVAS, CANVAS):
        img = img.resize((CANVAS, CANVAS), Image.Resampling.BILINEAR)
    px = np.asarray(img, dtype=np.float32)
    return ((px[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1).argmin(-1)


def shapes_colour(image: Any, objects: list[dict[str, str]]) -> float:
    """The ``shapes_colour`` reward of one image for the prompt's ``objects`` (module docstring)."""
    idx = palette_map(image)
    want = {o["position"]: _NAMES.index(o["colour"]) for o in objects}
    total = 0.0
    for position, (x0, y0) in POSITIONS.items():
        cell = idx[y0 : y0 + CELL, x0 : x0 + CELL]
        coloured = float((cell > 0).mean())
        if position in want:
            hit = float((cell == want[position]).mean())
            total += hit - (coloured - hit)
        else:
            total -= coloured
    return total / len(POSITIONS)


def shapes_hit(image: Any, objects: list[dict[str, str]]) -> float:
    """The ``shapes_hit`` score of one image for the prompt's ``objects`` (module docstring), in [0, 1]."""
    idx = palette_map(image)
    hits = 0
    for o in objects:
        x0, y0 = POSITIONS[o["position"]]
        counts = np.bincount(idx[y0 : y0 + CELL, x0 : x0 + CELL].ravel(), minlength=len(_NAMES))
        counts[0] = 0  # the background
        want = _NAMES.index(o["colour"])
        hits += int(counts.argmax() == want and counts[want] >= HIT_SHARE * CELL * CELL)
    return hits / len(objects)
