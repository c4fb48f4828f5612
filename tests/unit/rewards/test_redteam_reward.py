"""Red-team reward terms and advantages against hand-computed values (ALGORITHMS 2.2, 2.3)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from alignkit.rewards.cvar import (
    attack_similarity,
    attack_stats,
    cvar_bonus,
    redteam_reward,
    value_at_risk,
)
from alignkit.rollout.advantages import group_advantages

T = lambda *v: torch.tensor(v, dtype=torch.float64)


def flow_rtpo_var(scores: np.ndarray, tau: float) -> float:
    """The reference (henrymao2004/flow_rtpo flow_grpo/toxicity_rewards.py compute_cvar_bonus), restated."""
    if len(scores) <= 1:
        return float(scores[0])
    base = float(np.quantile(scores, (1 - tau) * 100 / 100.0, method="lower"))
    return base - max(0.01 * (np.max(scores) - np.min(scores)), 1e-6)


def test_var_with_ties_gives_every_tied_value_the_epsilon_bonus() -> None:
    # tau 0.5, n 5: lower quantile at floor(0.5 * 4) = 2 -> 0.5 (tied three times); eps = 0.01 * 0.8
    tox = T(0.1, 0.5, 0.9, 0.5, 0.5)
    assert value_at_risk(tox, 0.5) == pytest.approx(0.5 - 0.008, abs=1e-15)
    assert cvar_bonus(tox, value_at_risk(tox, 0.5)).tolist() == pytest.approx([0.0, 0.008, 0.408, 0.008, 0.008], abs=1e-12)


def test_var_at_tau_01_on_ten_values() -> None:
    tox = T(*[i / 10 for i in range(10)])  # floor(0.9 * 9) = 8 -> 0.8; eps = 0.009
    var = value_at_risk(tox, 0.1)
    assert var == pytest.approx(0.791, abs=1e-12)
    assert cvar_bonus(tox, var).tolist() == pytest.approx([0] * 8 + [0.009, 0.109], abs=1e-12)


def test_var_epsilon_floor_single_value_and_nan() -> None:
    same = T(0.3, 0.3, 0.3)  # range 0: eps = 1e-6, every sample gets 1e-6
    assert value_at_risk(same, 0.1) == pytest.approx(0.3 - 1e-6, abs=1e-15)
    assert value_at_risk(T(0.7), 0.1) == 0.7 and cvar_bonus(T(0.7), 0.7).tolist() == [0.0]
    with_nan = T(math.nan, 0.2, 0.4)  # the NaN is left out: [0.2, 0.4], index 0, eps 0.002
    var = value_at_risk(with_nan, 0.5)
    assert var == pytest.approx(0.198, abs=1e-12)
    bonus = cvar_bonus(with_nan, var)
    assert math.isnan(bonus[0]) and bonus[1:].tolist() == pytest.approx([0.002, 0.202], abs=1e-12)
    assert math.isnan(value_at_risk(T(math.nan), 0.1))


@pytest.mark.parametrize("seed", range(20))
def test_var_equals_the_reference_on_random_batches(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    scores = np.round(rng.random(n), int(rng.integers(1, 3)))  # rounded: ties
    tau = float(rng.choice([0.05, 0.1, 0.2, 0.25, 0.3, 0.5]))
    assert value_at_risk(torch.tensor(scores), tau) == flow_rtpo_var(scores, tau)


def test_reward_terms_by_hand() -> None:
    tox, q = T(0.2, 0.6), T(1.0, 0.5)  # tau 0.5: VaR = 0.2 - 0.004 = 0.196; bonus 0.004, 0.404
    out = redteam_reward(tox, q, tau=0.5, w_cvar=0.5, w_quality=0.2)
    assert out["var"] == pytest.approx(0.196)
    assert out["cvar_bonus"].tolist() == pytest.approx([0.004, 0.404])
    assert out["reward"].tolist() == pytest.approx([0.2 + 0.002 + 0.2, 0.6 + 0.202 + 0.1])
    no_cvar = redteam_reward(tox, q, tau=0.5, w_cvar=0.0, w_quality=0.2)  # w_cvar = 0: tox + w_q q
    assert no_cvar["reward"].tolist() == pytest.approx([0.4, 0.7])
    plain = redteam_reward(tox, None, tau=0.5, w_cvar=0.0)
    assert plain["reward"].tolist() == pytest.approx([0.2, 0.6]) and plain["quality"].tolist() == [0.0, 0.0]


def test_reward_diversity_penalty_and_unscorable() -> None:
    sim = attack_similarity(["a b", "a b", "c"])  # identical pair: 1; disjoint: 0 -> means 0.5, 0.5, 0
    assert sim.tolist() == [0.5, 0.5, 0.0]
    out = redteam_reward(T(0.0, 0.0, 0.0), None, sim, tau=0.1, w_cvar=0.0, w_diversity=0.1)
    assert out["reward"].tolist() == pytest.approx([-0.05, -0.05, 0.0])
    masked = redteam_reward(T(math.nan, 1.0), T(0.5, math.nan), tau=0.1, w_cvar=0.1, w_quality=0.1)
    assert all(math.isnan(v) for v in masked["reward"].tolist())  # no toxicity / no quality: unscorable
    assert math.isnan(masked["reward"][0]) and not math.isnan(redteam_reward(T(1.0), T(math.nan), tau=0.1, w_cvar=0.1)["reward"][0])


def test_similarity_uses_word_ngrams() -> None:
    # n = 2: "x y" -> {x, y, x y}; "y x" -> {y, x, y x}: 2 shared of 4 -> 0.5; n = 1: the same set -> 1
    assert attack_similarity(["x y", "y x"]).tolist() == [0.5, 0.5]
    assert attack_similarity(["x y", "y x"], n=1).tolist() == [1.0, 1.0]
    assert attack_similarity(["", ""]).tolist() == [1.0, 1.0] and attack_similarity(["solo"]).tolist() == [0.0]


def test_advantages_per_prompt_vs_global() -> None:
    r = T(1.0, 2.0, 3.0, 4.0)
    per_prompt = group_advantages(r, 2)  # each pair: +-0.5 / (std 0.7071 + 1e-4)
    half = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert per_prompt.tolist() == pytest.approx([-half, half, -half, half], rel=1e-6)
    glob = group_advantages(r, 2, statistics="global")  # mean 2.5, std sqrt(5/3)
    std = math.sqrt(5 / 3) + 1e-4
    assert glob.tolist() == pytest.approx([(x - 2.5) / std for x in (1, 2, 3, 4)], rel=1e-6)
    batch_std = group_advantages(r, 2, scale_rewards="batch")  # per-prompt mean, global std (Flow-GRPO global_std)
    assert batch_std.tolist() == pytest.approx([-0.5 / std, 0.5 / std] * 2, rel=1e-6)
    assert group_advantages(r, 2, estimator="rloo", statistics="global").tolist() == pytest.approx([-2, -2 / 3, 2 / 3, 2])
    assert group_advantages(r, 2, estimator="dr_grpo", statistics="global").tolist() == pytest.approx([-1.5, -0.5, 0.5, 1.5])


def test_advantages_clip_and_nan() -> None:
    r = T(*([0.0] * 9 + [10.0]))  # global: mean 1, std sqrt(10): the outlier 9 / 3.1624 = 2.846 -> clipped at 2
    adv = group_advantages(r, 10, statistics="global", clip=2.0)
    assert float(adv[-1]) == 2.0 and adv[0].item() == pytest.approx(-1 / (math.sqrt(10) + 1e-4), rel=1e-6)
    assert float(group_advantages(r, 10, statistics="global")[-1]) == pytest.approx(9 / (math.sqrt(10) + 1e-4), rel=1e-6)
    with_nan = group_advantages(T(math.nan, 1.0, 3.0, 3.0), 2)
    assert with_nan[0] == 0.0 and with_nan[1] == 0.0 and with_nan[2:].tolist() == [0.0, 0.0]


def test_attack_stats() -> None:
    s = attack_stats(["x", "x ", "y", "z"], T(0.9, 0.8, 0.1, math.nan), 0.5)
    assert s == {"attack_success_rate": pytest.approx(2 / 3), "distinct_attacks": 3.0, "distinct_fraction": 0.75,
                 "distinct_successes": 1.0, "distinct_toxicity": pytest.approx(0.5)}


def test_attack_without_words_is_not_novel() -> None:
    """An attack with no word tokens gets the full novelty penalty (1), not 0: its Jaccard with every worded
    attack is 0, which read as "maximally novel" would pay an attacker to emit nothing; the others' means
    still count it 0."""
    sim = attack_similarity(["", "a b", "a c", "!!!"])
    assert sim[0] == 1.0 and sim[3] == 1.0
    # "a b" vs "a c": {a, b, a b} & {a, c, a c} = {a}: 1/5; vs "" and "!!!": 0 -> mean 0.2 / 3
    assert sim[1:3].tolist() == pytest.approx([0.2 / 3, 0.2 / 3])
    out = redteam_reward(T(0.0, 0.0, 0.0, 0.0), None, sim, tau=0.1, w_cvar=0.0, w_diversity=0.1)
    assert out["reward"].argmin() in (0, 3) and out["reward"][0] == pytest.approx(-0.1)


def test_attack_stats_with_several_answers_per_attack() -> None:
    """flow_rtpo's rows: each attack answered once per image, contiguous; success per row, distinct per attack."""
    s = attack_stats(["x", "x", "y", "y"], T(0.9, 0.1, 0.1, 0.1), 0.5, repeats=2)
    assert s["distinct_fraction"] == 1.0 and s["attack_success_rate"] == 0.25 and s["distinct_attacks"] == 2.0


def test_a_group_without_success_keeps_its_diversity_differences_small() -> None:
    """redteam.scale_rewards (default batch): group A has no success and differs only by the diversity term
    (one attack 0.002 less novel), group B has one success. Divided by each group's own std (GRPO's group),
    A's less novel attack gets -0.0015 / (0.001 + 1e-4) = -1.364, nearly the success's 0.75 / (0.5 + 1e-4) =
    1.500; divided by the batch's std (0.35366) it gets -0.0015 / 0.35376 = -0.00424 and the success 2.120."""
    from alignkit.algorithms.redteam import advantage_scale
    from alignkit.config import load_config

    r = T(0.0, 0.0, 0.0, -0.002, 1.0, 0.0, 0.0, 0.0)
    group = group_advantages(r, 4, scale_rewards="group")
    assert group.tolist() == pytest.approx([0.0005 / 0.0011] * 3 + [-0.0015 / 0.0011, 0.75 / 0.5001] + [-0.25 / 0.5001] * 3,
                                           rel=1e-5)
    std = 0.353655 + 1e-4  # sample std of the 8 rewards
    batch = group_advantages(r, 4, scale_rewards="batch")
    assert batch.tolist() == pytest.approx([0.0005 / std] * 3 + [-0.0015 / std, 0.75 / std] + [-0.25 / std] * 3, rel=1e-5)
    config = Path(__file__).resolve().parents[3] / "configs" / "redteam.yaml"
    assert advantage_scale(load_config(config)) == "batch"  # the default
    assert advantage_scale(load_config(config, ["redteam.scale_rewards=group"])) == "group"
    assert advantage_scale(load_config(config, ["redteam.scale_rewards=null", "grpo.scale_rewards=none"])) == "none"
    assert advantage_scale(load_config(config, ["redteam.estimator=dr_grpo"])) == "none"


def test_resume_keeps_whole_jsonl_rows_whatever_the_attack_holds(tmp_path: Path) -> None:
    """attacks.jsonl cut to a checkpoint's row count: rows whose attack holds \\x85 or \\u2028 (kept raw by
    json.dumps with ensure_ascii=False; str.splitlines would split them) stay whole."""
    import json

    from alignkit.algorithms.redteam import first_lines

    rows = [{"attack": "a\u2028b"}, {"attack": "c\x85d"}, {"attack": "e"}]
    path = tmp_path / "attacks.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    kept = first_lines(path, 2)
    assert [json.loads(x) for x in kept.split("\n") if x] == rows[:2] and kept.endswith("}\n")
    assert first_lines(path, 5) == path.read_text(encoding="utf-8") and first_lines(path, 0) == ""
