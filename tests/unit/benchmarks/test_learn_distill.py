"""benchmarks/learn_distill.py: the pure pieces (the fraction of the teacher's lead closed, the per-arm intervals,
the paired distill - SFT difference and the report), on a hand-computed result; no learning run. And the held-out
KL to the teacher on two random micro models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import learn_distill as ld


def run(seed: int, expected: list[float], kl: float = 0.5) -> dict:
    return {"seed": seed, "seconds": 1.0,
            "eval": {str(c): {"expected": e, "sampled": e, "kl": kl} for c, e in zip((20, 40, 60), expected)}}


def result() -> dict:
    # S0 0.1, T 0.5: lead 0.4; distill at step 60 ends 0.3 / 0.5 (closed 0.5 / 1.0), SFT 0.2 / 0.3 (0.25 / 0.5)
    return {"start": {"expected": 0.1, "sampled": 0.1, "kl": 1.0},
            "teacher": {"expected": 0.5, "sampled": 0.5, "kl": 0.0},
            "checkpoints": [20, 40, 60], "setup_text": "x", "stamp": "now",
            "runs": {"distill (0.001)": [run(0, [0.1, 0.2, 0.3], 0.4), run(1, [0.3, 0.4, 0.5], 0.2)],
                     "sft (0.003)": [run(0, [0.1, 0.1, 0.2]), run(1, [0.2, 0.2, 0.3])]}}


def test_fraction_closed_is_relative_to_the_lead() -> None:
    s0, t = {"expected": 0.1}, {"expected": 0.5}
    assert ld.closed(0.3, s0, t, "expected") == pytest.approx(0.5)
    assert ld.closed(0.5, s0, t, "expected") == pytest.approx(1.0)
    assert ld.closed(0.05, s0, t, "expected") == pytest.approx(-0.125)  # below the start: negative


def test_summary_pairs_distill_and_sft_by_seed() -> None:
    r = result()
    s = ld.summarize(r)
    final = s["arms"]["distill (0.001)"]["60"]["expected"]["closed"]
    assert final["mean"] == pytest.approx(0.75) and final["n"] == 2
    assert s["arms"]["sft (0.003)"]["60"]["expected"]["closed"]["mean"] == pytest.approx(0.375)
    pair = s["paired"]["distill (0.001) - sft (0.003)"]["60"]["expected"]
    # per seed differences: 0.5 - 0.25 = 0.25, 1.0 - 0.5 = 0.5
    assert pair["mean"] == pytest.approx(0.375) and pair["higher"] == 2 and pair["lower"] == 0
    md = ld.markdown({**r, "summary": s})
    assert "distill (0.001) - sft (0.003)" in md and "+0.750" in md
    assert "| distill (0.001) | 0.300 | 0.300 | 0.300 |" in md and "S0 1.000" in md  # KL: mean of 0.4 and 0.2


def test_no_pair_when_seeds_differ() -> None:
    r = result()
    r["runs"]["sft (0.003)"] = r["runs"]["sft (0.003)"][:1]
    assert ld.summarize(r)["paired"] == {}


def test_held_out_kl_is_zero_to_itself_and_positive_to_another_model(micro_model: Path, tmp_path: Path) -> None:
    from alignkit.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", size="micro", seed=1)  # same tokenizer, other weights
    rows = [("What is 12+34?", "46"), ("What is 56+78?", "134"), ("What is 9+10?", "19")]  # two prompt lengths
    assert ld.held_out_kl(str(micro_model), str(micro_model), rows) == pytest.approx(0.0, abs=1e-6)
    assert ld.held_out_kl(str(micro_model), str(other), rows) > 0.01  # 0.025 measured (random inits: near uniform)
