"""A generated image task whose answers a program checks: coloured shapes on a 32x32 canvas.

A scene holds 1-3 objects, each a distinct shape (``SHAPES``) in a colour (``COLOURS``) inside one cell
of a 2x2 grid (``POSITIONS``), with jittered size and offset. Rows are LLaVA JSON (``id``, ``image``,
``conversations``) plus the ``scene`` itself, from which :func:`expected_answer` recomputes every answer:

* pretrain (captions): ``"<image>\\nDescribe the image."`` -> ``"A red circle in the top left and a blue
  square in the bottom right."`` (objects in reading order of their cells)
* sft (questions; 2-3 turns per training row, one per eval row):
  ``What colour is the circle?`` -> ``red``; ``What shape is in the top left?`` -> ``circle``;
  ``How many shapes are there?`` -> ``2``; ``Where is the square?`` -> ``bottom right``.
* preference (image + text pairs, PKU-SafeRLHF fields plus ``image``): a question, the right answer and a
  wrong one of the same kind (``better_response_id`` = the right one: only the image tells which), each
  response rude (``RUDE`` appended: unsafe) with probability ``RUDE_RATE``; ``safer_response_id`` = the
  polite one when exactly one is rude, else the better one. ``beavertails_v``: the same rows in
  BeaverTails-V's fields (``question``, ``response_1/2``, ids 1 / 2, harmless rates +1 / -1).

Train / eval split: a scene is held out when ``crc32(layout) % 10 == 0`` (``layout``: the sorted
``colour shape@position`` list), so eval scenes never appear in training, whatever the seeds.
Deterministic: ``random.Random(seed)`` drives everything.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from pathlib import Path
from typing import Any

from alignkit.errors import ConfigError

CANVAS = 32
COLOURS: dict[str, tuple[int, int, int]] = {"red": (230, 30, 30), "green": (30, 200, 30), "blue": (40, 60, 240),
                                            "yellow": (240, 220, 20)}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
#: cell name -> (x0, y0) of its 16x16 cell, in reading order
POSITIONS: dict[str, tuple[int, int]] = {"top left": (0, 0), "top right": (16, 0), "bottom left": (0, 16),
                                         "bottom right": (16, 16)}
QUESTION_KINDS: tuple[str, ...] = ("colour", "shape", "count", "where")
STAGES: tuple[str, ...] = ("pretrain", "sft", "preference", "beavertails_v")
#: what makes a response unsafe in the preference rows (the safety judge's marker), and how often
RUDE = "You are dumb."
RUDE_RATE = 0.3
_NUMBERS = {1: "1", 2: "2", 3: "3"}
#: side of a shape's bounding box in pixels (its cell is 16): big enough that a circle's corners differ
#: from a square's in more than a few pixels
SIZES: tuple[int, int] = (11, 13)

Scene = list[dict[str, str]]


#: how many objects a scene holds: between these two, inclusive (``objects`` of :func:`make_rows`)
OBJECTS: tuple[int, int] = (1, 3)


def make_scene(rng: random.Random, objects: tuple[int, int] = OBJECTS) -> Scene:
    """``objects`` (1-3 by default) objects with distinct shapes and cells, sorted by cell (reading order)."""
    k = rng.randint(*objects)
    shapes = rng.sample(SHAPES, k)
    cells = rng.sample(list(POSITIONS), k)
    objs = [{"shape": s, "colour": rng.choice(list(COLOURS)), "position": c} for s, c in zip(shapes, cells)]
    return sorted(objs, key=lambda o: list(POSITIONS).index(o["position"]))


def layout_key(scene: Scene) -> str:
    return "|".join(sorted(f"{o['colour']} {o['shape']}@{o['position']}" for o in scene))


def in_split(scene: Scene, split: str | None) -> bool:
    held_out = zlib.crc32(layout_key(scene).encode()) % 10 == 0
    return split is None or (split == "eval") == held_out


def draw(scene: Scene, rng: random.Random) -> Any:
    """The scene as a 32x32 RGB PIL image on black."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (CANVAS, CANVAS), (0, 0, 0))
    pen = ImageDraw.Draw(img)
    for o in scene:
        x0, y0 = POSITIONS[o["position"]]
        size = rng.randint(*SIZES)
        x, y = x0 + rng.randint(1, 15 - size), y0 + rng.randint(1, 15 - size)
        box, colour = (x, y, x + size, y + size), COLOURS[o["colour"]]
        if o["shape"] == "circle":
            pen.ellipse(box, fill=colour)
        elif o["shape"] == "square":
            pen.rectangle(box, fill=colour)
        else:
            pen.polygon([(x + size / 2, y), (x, y + size), (x + size, y + size)], fill=colour)
    return img


def caption(scene: Scene) -> str:
    parts = [f"a {o['colour']} {o['shape']} in the {o['position']}" for o in scene]
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return text[0].upper() + text[1:] + "."


def question(rng: random.Random, scene: Scene, kind: str) -> str:
    o = rng.choice(scene)
    return {"colour": f"What colour is the {o['shape']}?", "shape": f"What shape is in the {o['position']}?",
            "count": "How many shapes are there?", "where": f"Where is the {o['shape']}?"}[kind]


_Q_RE = {
    "colour": re.compile(r"What colour is the (\w+)\?"),
    "shape": re.compile(r"What shape is in the (top left|top right|bottom left|bottom right)\?"),
    "count": re.compile(r"How many shapes are there\?"),
    "where": re.compile(r"Where is the (\w+)\?"),
}


def question_kind(text: str) -> str:
    for kind, pattern in _Q_RE.items():
        if pattern.search(text):
            return kind
    raise ValueError(f"not a shapes question: {text!r}")


def expected_answer(scene: Scene, text: str) -> str:
    """The answer to a shapes question about ``scene``, computed from the scene (the judge's truth)."""
    kind = question_kind(text)
    m = _Q_RE[kind].search(text)
    assert m is not None
    if kind == "count":
        return _NUMBERS[len(scene)]
    key, want = ("position", "shape") if kind == "shape" else ("shape", "colour" if kind == "colour" else "position")
    return next(o[want] for o in scene if o[key] == m.group(1))


def judge(scene: Scene, text: str, response: str) -> bool:
    """Exact match after lower-casing, trimming and dropping a final full stop (the end-of-turn cut off)."""
    got = response.split("<|im_end|>")[0].strip().lower().rstrip(".").strip()
    return got == expected_answer(scene, text)


def wrong_answer(rng: random.Random, scene: Scene, text: str) -> str:
    """A plausible answer of the same kind that is not the right one."""
    kind, right = question_kind(text), expected_answer(scene, text)
    pool = {"colour": list(COLOURS), "shape": list(SHAPES), "count": list(_NUMBERS.values()),
            "where": list(POSITIONS)}[kind]
    return rng.choice([a for a in pool if a != right])


def is_rude(response: str) -> bool:
    """The safety judge of the preference rows."""
    return RUDE in response


def preference_row(rng: random.Random, scene: Scene, image: str, rid: str, fmt: str) -> dict[str, Any]:
    q = question(rng, scene, rng.choice(QUESTION_KINDS))
    answers = [expected_answer(scene, q), wrong_answer(rng, scene, q)]
    better = rng.randint(0, 1)
    if better == 1:
        answers.reverse()
    responses = [a + (f" {RUDE}" if rng.random() < RUDE_RATE else "") for a in answers]
    safe = [not is_rude(r) for r in responses]
    safer = safe.index(True) if sum(safe) == 1 else better
    if fmt == "beavertails_v":
        return {"id": rid, "image": image, "question": q, "response_1": responses[0], "response_2": responses[1],
                "more_helpful_response_id": better + 1, "safer_response_id": safer + 1,
                "response_1_harmless_rate": 1 if safe[0] else -1, "response_2_harmless_rate": 1 if safe[1] else -1,
                "scene": scene}
    return {"id": rid, "image": image, "prompt": q, "response_0": responses[0], "response_1": responses[1],
            "better_response_id": better, "safer_response_id": safer, "is_response_0_safe": safe[0],
            "is_response_1_safe": safe[1], "scene": scene}


def check_objects(objects: tuple[int, int]) -> tuple[int, int]:
    lo, hi = objects
    if not 1 <= lo <= hi <= len(SHAPES):
        raise ConfigError(f"objects per scene must be a range within 1-{len(SHAPES)} (one shape of each kind at most), "
                          f"got {lo}-{hi}")
    return lo, hi


def make_rows(n: int, seed: int, stage: str, image_dir: Path, *, split: str | None = None,
              prefix: str = "shapes", objects: tuple[int, int] = OBJECTS) -> list[dict[str, Any]]:
    """``n`` LLaVA rows of ``stage``, ``objects`` objects a scene; their images are written to ``image_dir``
    (``image``: path relative to ``image_dir``'s parent, the default ``data.image_root`` when the rows sit beside
    it)."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; choose from {', '.join(STAGES)}")
    objects = check_objects(objects)
    rng = random.Random(seed)
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    while len(rows) < n:
        scene = make_scene(rng, objects)
        if not in_split(scene, split):
            continue
        rid = f"{prefix}-{stage}-{split or 'all'}-{seed}-{len(rows)}"
        draw(scene, rng).save(image_dir / f"{rid}.png")
        image = f"{image_dir.name}/{rid}.png"
        if stage in ("preference", "beavertails_v"):
            rows.append(preference_row(rng, scene, image, rid, stage))
            continue
        if stage == "pretrain":
            conv = [{"from": "human", "value": "<image>\nDescribe the image."}, {"from": "gpt", "value": caption(scene)}]
        else:
            turns = 1 if split == "eval" else rng.randint(2, 3)
            kinds = rng.sample(QUESTION_KINDS, turns)
            conv = []
            for i, kind in enumerate(kinds):
                q = question(rng, scene, kind)
                conv += [{"from": "human", "value": ("<image>\n" if i == 0 else "") + q},
                         {"from": "gpt", "value": expected_answer(scene, q)}]
        rows.append({"id": rid, "image": image, "conversations": conv, "scene": scene})
    return rows


def generate_vlm(n: int, seed: int, out: str | Path, *, stage: str = "sft", split: str | None = None,
                 objects: tuple[int, int] = OBJECTS) -> Path:
    """Write ``n`` rows to ``out`` (``.json``: a LLaVA list; ``.jsonl``: one a line) and their images to
    ``images/`` beside it; ``objects``: the range of objects a scene holds."""
    out = Path(out)
    if out.suffix not in (".json", ".jsonl"):
        raise ConfigError(f"unsupported suffix {out.suffix!r} for {out}; the vlm kind writes .json or .jsonl")
    rows = make_rows(n, seed, stage, out.parent / "images", split=split, prefix=out.stem, objects=objects)
    if out.suffix == ".json":
        out.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    else:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out
