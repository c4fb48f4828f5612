"""The dual update's two rules (``lambda_update``): the PID Lagrangian step by hand (Stooke et al. 2020,
Algorithm 2, with rlpyt's EMA and delay), the Multiplier in both modes, its state through JSON, old
checkpoints, and the keys being the same in ``safe_dpo:`` and ``ppo_lag:``."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from pytest import approx

from alignkit.algorithms.lagrange import LAMBDA_FLOOR, DualConfig, Multiplier
from alignkit.losses.safe_dpo import PIDState, pid_lagrange_update, safe_dpo_loss


def run(js: list[float], state: PIDState, **kw) -> list[float]:
    out = []
    for j in js:
        lam, state = pid_lagrange_update(state, j, **kw)
        out.append(lam)
    return out


def test_pid_by_hand_p_i_with_anti_windup_and_d_only_on_rising_cost() -> None:
    kw = dict(threshold=0.0, kp=0.5, ki=0.1, kd=1.0, lam_max=10.0)
    # J_C:  2 -> e=2, I=1.2, P=2, no D yet:            0.5*2 + 1.2            = 2.2
    #       3 -> e=3, I=1.5, D = 3-2 = 1:              0.5*3 + 1.5 + 1        = 4.0
    #      -1 -> I=1.4, falling cost: D = 0:          -0.5 + 1.4              = 0.9
    #     -20 -> I = max(0, 1.4-2) = 0 (not -0.6):     max(0, -10 + 0)        = 0
    #       1 -> I = 0.1 (no wound-up -0.5), D = 21:   0.5 + 0.1 + 21 = 21.6  -> lambda_max 10
    #       1 -> I = 0.2, D = 0:                       0.5 + 0.2              = 0.7
    lams = run([2.0, 3.0, -1.0, -20.0, 1.0, 1.0], PIDState(1.0), **kw)
    assert lams == approx([2.2, 4.0, 0.9, 0.0, 10.0, 0.7])
    assert lams[3] == 0.0 and isinstance(lams[3], float)


def test_pid_ema_and_derivative_delay_by_hand() -> None:
    kw = dict(threshold=1.0, kp=1.0, ki=0.0, kd=1.0, lam_max=10.0, d_delay=2, ema_alpha=0.5)
    # J_C 3: e=2, P=2 (seeded), C=3, D=0                        -> 2 + 0.5          = 2.5   history (3,)
    # J_C 5: P=.5*2+.5*4=3, C=.5*3+.5*5=4, D=4-3=1              -> 3 + 0.5 + 1      = 4.5   history (3, 4)
    # J_C 1: P=1.5, C=2.5, D=max(0, 2.5-3)=0                    -> 1.5 + 0.5        = 2.0   history (4, 2.5)
    # J_C 7: P=.75+3=3.75, C=1.25+3.5=4.75, D=4.75-4 (2 back)   -> 3.75 + 0.5 + .75 = 5.0
    assert run([3.0, 5.0, 1.0, 7.0], PIDState(0.5), **kw) == approx([2.5, 4.5, 2.0, 5.0])
    lam, state = pid_lagrange_update(PIDState(1.0), 10.0, threshold=0.0, kp=0.0, ki=1.0, kd=0.0, lam_max=2.0)
    assert lam == 2.0 and state.integral == 2.0  # the integral stops at lambda_max too
    with pytest.raises(ValueError):
        pid_lagrange_update(PIDState(1.0), 0.0, threshold=0.0, kp=0.1, ki=0.1, kd=0.1, lam_max=1.0, ema_alpha=1.0)


def pid_section(**kw) -> SimpleNamespace:
    base = {f.name: f.default for f in dataclasses.fields(DualConfig)}
    base.update(lambda_update="pid", threshold=0.0, lambda_init=1.0, lambda_lr=0.05, lambda_max=10.0)
    base.update(kw)
    return SimpleNamespace(**base)


def test_multiplier_pid_mode_window_and_json_resume_mid_run() -> None:
    m = Multiplier.from_config(pid_section(pid_kp=0.5, pid_ki=0.1, pid_kd=1.0, pid_d_delay=2,
                                           pid_ema_alpha=0.5), window=2)
    assert m.value == 1.0  # lambda_init, before any update
    m.update([1.0, 3.0])  # J_C = 2: e=2, I=1.2, P=2 -> 0.5*2 + 1.2
    assert m.j_c == 2.0 and m.value == approx(2.2)
    m.update([5.0])  # window [3, 5]: J_C=4, I=1.6, P=3, C=3, D=1 -> 1.5 + 1.6 + 1
    assert m.j_c == 4.0 and m.value == approx(4.1)
    saved = json.loads(json.dumps(m.state_dict()))
    assert set(saved) == {"lambda", "cost_window", "J_C", "updates", "pid"}
    fresh = Multiplier.from_config(pid_section(pid_kp=0.5, pid_ki=0.1, pid_kd=1.0, pid_d_delay=2,
                                               pid_ema_alpha=0.5), window=2)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == m.state_dict()
    for costs in ([-9.0], [-9.0, -9.0], [2.0], [0.5]):
        m.update(costs)
        fresh.update(costs)
        assert fresh.value == m.value and fresh.state_dict() == m.state_dict()
    m.update([-100.0, -100.0])
    assert m.value == 0.0  # exactly 0: the PID lambda is stored as itself, nothing takes its log


def test_gradient_rule_unchanged_through_from_config() -> None:
    sec = pid_section(lambda_update="gradient", lambda_lr=0.1, lambda_max=2.0)
    m, old = Multiplier.from_config(sec, window=4), Multiplier(0.0, 0.0, 0.1, 2.0, 4)
    for costs in ([1.0, 3.0], [-1.0, -1.0, -1.0], [-5.0], [10.0]):
        m.update(costs)
        old.update(costs)
        assert m.value == old.value
    assert set(m.state_dict()) == {"log_lambda", "cost_window", "J_C", "updates"}  # the format before PID


def test_old_checkpoints_load_into_either_rule() -> None:
    old = {"log_lambda": math.log(3.0), "cost_window": [1.0], "J_C": 1.0, "updates": 4}
    m = Multiplier.from_config(pid_section(pid_kp=0.0, pid_ki=0.5, pid_kd=0.0), window=4)
    m.load_state_dict(old)
    assert m.value == approx(3.0) and m.updates == 4
    m.update([1.0])  # the integral took over lambda = 3: I = 3 + 0.5 * mean(1, 1)
    assert m.value == approx(3.5)
    g = Multiplier.from_config(pid_section(lambda_update="gradient"), window=4)
    g.load_state_dict({"lambda": 0.0, "cost_window": [], "J_C": None, "updates": 1, "pid": {}})
    assert g.value == approx(LAMBDA_FLOOR)  # a PID checkpoint's lambda = 0 has no log: floored


def test_mixes_at_lambda_zero_are_the_helpful_term() -> None:
    loss_h, loss_s = torch.tensor([0.7, 0.2]), torch.tensor([5.0, 9.0])
    assert torch.equal(safe_dpo_loss(loss_h, loss_s, 0.0), loss_h)


def test_both_sections_have_the_same_dual_keys() -> None:
    import alignkit.algorithms  # noqa: F401 - registrations
    from alignkit.algorithms.ppo import PPOLagConfig
    from alignkit.algorithms.safe_dpo import SafeDPOConfig

    names = [f.name for f in dataclasses.fields(DualConfig)]
    assert names == ["lambda_update", "pid_kp", "pid_ki", "pid_kd", "pid_d_delay", "pid_ema_alpha", "cost_margin"]
    for section in (SafeDPOConfig, PPOLagConfig):
        fields = {f.name: f for f in dataclasses.fields(section)}
        for name in names + ["threshold", "lambda_init", "lambda_lr", "lambda_max"]:
            assert name in fields, (section, name)
    # safe_dpo's default is the PID dual measured on the toy safety world; ppo_lag keeps Safe RLHF's rule
    assert (SafeDPOConfig().lambda_update, PPOLagConfig().lambda_update) == ("pid", "gradient")


def test_ppo_lag_builds_the_pid_multiplier_from_its_section(micro_model) -> None:
    """ppo_lag reads the same keys: its dual step after an iteration is the PID step on the window of
    iteration mean costs, lambda 0 is fine, and its state resumes exactly."""
    from alignkit.algorithms import ALGORITHMS
    from alignkit.config.loader import apply_overrides, build_dataclass
    from alignkit.config.schema import RunConfig
    from alignkit.metrics import MetricSums
    from alignkit.models.loading import load_tokenizer
    from alignkit.rollout.context import Experience

    raw = {"algorithm": "ppo_lag", "model": {"name_or_path": str(micro_model)}, "data": {"train": "x.jsonl"},
           "training": {"per_device_batch_size": 4}}
    cfg = build_dataclass(RunConfig, apply_overrides(raw, [
        "ppo_lag.cost_functions=[{name: length}]", "ppo_lag.lambda_update=pid", "ppo_lag.pid_kp=0.5",
        "ppo_lag.pid_ki=0.1", "ppo_lag.pid_kd=1.0", "ppo_lag.window=1"]))
    tok = load_tokenizer(cfg.model)
    algo, twin = ALGORITHMS.get("ppo_lag")(cfg, tok), ALGORITHMS.get("ppo_lag")(cfg, tok)
    lams = []

    def costs(mean: float) -> Experience:  # an iteration whose gathered costs average ``mean`` (a NaN left out)
        return Experience([], {"cost": torch.tensor([mean - 1.0, float("nan"), mean + 1.0])}, MetricSums())

    for cost in (2.0, 3.0, -1.0, -20.0):  # the first test's sequence, window 1: 2.2, 4.0, 0.9, 0
        lams.append(algo.on_iteration_end(None, costs(cost))["lambda"])
        if cost == 3.0:
            twin.load_state_dict(json.loads(json.dumps(algo.state_dict())))
            assert twin.on_iteration_end(None, costs(-1.0))["lambda"] == approx(0.9)
    # every cost unscorable: no entry for the window, lambda stays
    assert algo.on_iteration_end(None, Experience([], {"cost": torch.full((2,), float("nan"))}, MetricSums()))["lambda"] == 0.0
    assert lams == approx([2.2, 4.0, 0.9, 0.0]) and algo.lam == 0.0


@pytest.mark.parametrize("rule", ["gradient", "pid"])
def test_cost_margin_moves_the_target_below_the_threshold(rule: str) -> None:
    """J_C inside the budget (J_C < threshold) but above threshold - cost_margin: lambda still rises."""
    plain = Multiplier.from_config(pid_section(lambda_update=rule, threshold=1.0), window=1)
    margin = Multiplier.from_config(pid_section(lambda_update=rule, threshold=1.0, cost_margin=0.5), window=1)
    start = margin.value
    for m in (plain, margin):
        m.update([0.75])
    assert plain.value < start < margin.value
    same = Multiplier.from_config(pid_section(lambda_update=rule, threshold=0.5), window=1)
    same.update([0.75])
    assert same.value == margin.value  # threshold 1 with margin 0.5 is target 0.5
