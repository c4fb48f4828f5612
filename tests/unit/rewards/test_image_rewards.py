"""The shapes_colour image reward: prompts parsed into objects, the drawn scenes scoring above wrong colours and
noise, and the red-team scorer entry (NaN for a prompt naming no object)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from alignkit.data.synth_vlm import caption, draw, make_rows, make_scene
from alignkit.rewards.image import prompt_objects, shapes_colour, shapes_hit


def test_prompt_objects_reads_colour_shape_and_position() -> None:
    text = "A red circle in the top left, a blue square in the bottom right and a green triangle in the top right."
    assert prompt_objects(text) == [{"colour": "red", "shape": "circle", "position": "top left"},
                                    {"colour": "blue", "shape": "square", "position": "bottom right"},
                                    {"colour": "green", "shape": "triangle", "position": "top right"}]
    assert prompt_objects("a cat on a mat") == []


def test_shapes_colour_by_hand_on_a_filled_cell() -> None:
    from PIL import Image

    img = Image.new("RGB", (32, 32), (0, 0, 0))
    img.paste((230, 30, 30), (0, 0, 16, 8))  # the top half of the top-left cell red
    img.paste((40, 60, 240), (16, 16, 32, 32))  # the whole bottom-right cell blue
    objs = prompt_objects("A red circle in the top left.")
    # top left: 0.5 red - 0 other = 0.5; bottom right should be empty: -1; the other two: 0 -> (0.5 - 1) / 4
    assert shapes_colour(img, objs) == pytest.approx(-0.125)
    # asking for green there instead: 0 green - 0.5 other
    assert shapes_colour(img, prompt_objects("A green circle in the top left.")) == pytest.approx((-0.5 - 1) / 4)


def test_shapes_hit_by_hand() -> None:
    from PIL import Image

    img = Image.new("RGB", (32, 32), (0, 0, 0))
    img.paste((230, 30, 30), (0, 0, 16, 8))  # half the top-left cell red
    img.paste((40, 60, 240), (0, 8, 4, 16))  # and an eighth of it blue: red is still the cell's colour
    img.paste((30, 200, 30), (16, 16, 18, 18))  # 4 green pixels in the bottom right: under HIT_SHARE of the cell
    objs = prompt_objects("A red circle in the top left and a green square in the bottom right.")
    assert shapes_hit(img, objs) == 0.5
    assert shapes_hit(img, prompt_objects("A blue circle in the top left.")) == 0.0
    img.paste((30, 200, 30), (16, 16, 24, 24))  # a quarter of the cell
    assert shapes_hit(img, objs) == 1.0


def test_one_object_scenes_and_the_objects_range() -> None:
    from alignkit.errors import ConfigError

    rng = random.Random(0)
    assert all(len(make_scene(rng, (1, 1))) == 1 for _ in range(50))
    assert {len(make_scene(rng)) for _ in range(50)} == {1, 2, 3}
    with pytest.raises(ConfigError, match="within 1-3"):
        make_rows(1, 0, "pretrain", Path("unused"), objects=(0, 2))


def test_drawn_scenes_score_above_wrong_colours_and_noise() -> None:
    rng, swap = random.Random(0), {"red": "blue", "blue": "green", "green": "yellow", "yellow": "red"}
    noise = np.random.default_rng(0)
    from PIL import Image

    for _ in range(20):
        scene = make_scene(rng)
        objs = prompt_objects(caption(scene))
        assert len(objs) == len(scene)
        right = shapes_colour(draw(scene, rng), objs)
        wrong = shapes_colour(draw([dict(o, colour=swap[o["colour"]]) for o in scene], rng), objs)
        random_img = Image.fromarray(noise.integers(0, 255, (32, 32, 3), dtype=np.uint8))
        assert right > 0.05 and wrong < -0.05 and shapes_colour(random_img, objs) < right
        assert shapes_hit(draw(scene, rng), objs) == 1.0 and shapes_hit(draw([dict(o, colour=swap[o["colour"]])
                                                                           for o in scene], rng), objs) == 0.0


def test_shapes_colour_scorer_entry() -> None:
    from alignkit.algorithms.redteam import RedTeamScorerConfig
    from alignkit.errors import ConfigError
    from alignkit.rewards.scorers import Judged, build_scorer

    scorer = build_scorer(RedTeamScorerConfig(name="shapes_colour"), None)
    rng = random.Random(1)
    scene = make_scene(rng)
    texts = [caption(scene), "a cat"]
    images = [draw(scene, rng), draw(scene, rng)]
    values = scorer(Judged(texts, ["", ""], texts, [{}, {}], images), torch.device("cpu"))
    assert values[0] is not None and values[0] > 0 and values[1] is None
    with pytest.raises(ConfigError, match="rendered images"):
        scorer(Judged(texts, ["", ""], texts, [{}, {}], [None, None]), torch.device("cpu"))
    hit = build_scorer(RedTeamScorerConfig(name="shapes_hit"), None)
    assert hit(Judged(texts, ["", ""], texts, [{}, {}], images), torch.device("cpu")) == [1.0, None]
    with pytest.raises(ConfigError, match="shapes_hit scores rendered images"):
        hit(Judged(texts, ["", ""], texts, [{}, {}], [None, None]), torch.device("cpu"))


def test_flow_grpo_scorer_and_prompt_errors_name_their_key(tmp_path) -> None:
    from alignkit.config import load_config
    from alignkit.data.captions import ImagePromptData
    from alignkit.errors import ConfigError, DataError
    from tests.conftest import REPO

    config = REPO / "configs" / "flow_grpo.yaml"
    with pytest.raises(ConfigError, match=r"flow_grpo.scorers: unknown scorer 'shape_colour'.*shapes_colour"):
        load_config(config, ["flow_grpo.scorers=[{name: shape_colour}]"])
    from alignkit.algorithms.flow_grpo import FlowGRPO

    with pytest.raises(ConfigError, match="flow_grpo.scorers: name at least one main reward"):
        FlowGRPO(load_config(config, ["flow_grpo.scorers=[{name: shapes_colour, use: quality}]"]), None)
    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"prompt": "A red circle in the top left."}\n{"text2": "no prompt"}\n')
    cfg = load_config(config, [f"data.train={rows}"])
    with pytest.raises(DataError, match=r"prompts.jsonl:2: an image/caption row needs 'caption'"):
        ImagePromptData(cfg.data).build_dataset([str(rows)], "train")
