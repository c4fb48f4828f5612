"""The shipped recipes and the demo draw eval curves of more than one point: with an eval set, the untrained
eval at step 0 (training.eval_before_train) and, where the run's length is fixed, evals before the last step."""

from __future__ import annotations

from pathlib import Path

import pytest

import alignkit.algorithms  # noqa: F401  (registers the algorithms' config sections)
from alignkit.config import load_config
from alignkit.resources import resource_path

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "configs").glob("*.yaml")) + [Path(resource_path("demo_sft.yaml"))]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_eval_curves_have_more_than_one_point(path: Path) -> None:
    cfg = load_config(path, notes=False)
    if not cfg.data.eval:
        return
    t = cfg.training
    assert t.eval_before_train is not False, "the untrained eval is the curve's first point (null: with eval data)"
    if t.max_steps is not None:
        assert t.eval_steps is not None and t.eval_steps < t.max_steps, (t.eval_steps, t.max_steps)


def test_the_demo_curves_start_at_the_untrained_values() -> None:
    cfg = load_config(resource_path("demo_sft.yaml"), notes=False)
    assert cfg.logging.logging_first_step and cfg.training.eval_before_train is not False and cfg.data.eval
    assert cfg.training.max_steps // cfg.training.eval_steps + 1 >= 5  # eval points, step 0 included
