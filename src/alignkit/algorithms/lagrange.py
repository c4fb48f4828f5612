"""The one Lagrange multiplier of a cost constraint J_C <= d, used by Safe-MM-DPO and Lagrangian PPO
(Safe RLHF, ALGORITHMS 1.3).

:class:`Multiplier` holds lambda and a window of recent costs; :meth:`Multiplier.update` takes the
costs of every rank (the same list on every rank), lets rank 0 apply the update rule to the window mean
and broadcasts rank 0's state, so every rank holds the same lambda and window. Two rules
(``lambda_update``, keys of :class:`DualConfig` that ``safe_dpo:`` and ``ppo_lag:`` both inherit):

- ``gradient``: ``lagrange_update``, gradient ascent on ln lambda (Safe RLHF); lambda is stored as
  ``log_lambda`` and stays > 0.
- ``pid``: ``pid_lagrange_update``, the PID Lagrangian (Stooke, Achiam & Abbeel 2020); lambda is stored
  as itself and may be exactly 0 (nothing takes its log; both mixes, (loss_H + lambda loss_S) / (1 +
  lambda) and (A_r - lambda A_c) / (1 + lambda), are then the helpful / reward term alone).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from alignkit.config.schema import f
from alignkit.distributed import comm
from alignkit.losses.safe_dpo import PIDState, lagrange_update, pid_lagrange_update

#: a PID checkpoint's lambda read by the gradient rule, which works on ln lambda (0 has none)
LAMBDA_FLOOR = 1e-6


@dataclass
class DualConfig:
    """The keys that pick and tune the dual update, the same in ``safe_dpo:`` and ``ppo_lag:`` (both
    sections inherit them). The PID gains are in cost units, for cost-model scores of order 1 (J_C within
    a few of ``threshold``) already averaged over a window: K_P 0.1 as omnisafe's CPPOPID, K_I 0.05 = the
    default lambda_lr (the integral then moves lambda as fast as the gradient rule does at lambda = 1),
    K_D 0.5 over 4 updates; on toy closed loops (lagged / inertial / slow policy responses, noisy J_C)
    these ended closer to the threshold than gradient, omnisafe's gains, or a larger K_P. Not tuned on
    training runs."""

    lambda_update: Literal["gradient", "pid"] = f(
        "gradient", "Dual update: gradient (ln lambda += lambda_lr * lambda * (J_C - threshold), Safe RLHF) or pid "
        "(lambda = Kp P + I + Kd D, Stooke et al. 2020: damps the rise-fall-rise oscillation of gradient, use it "
        "when J_C ends a run above the threshold after having met it).")
    pid_kp: float = f(0.1, "pid: proportional gain on the (EMA of the) error J_C - threshold.", ge=0)
    pid_ki: float = f(0.05, "pid: integral gain, I += pid_ki * (J_C - threshold), I kept in [0, lambda_max] "
                      "(starts at lambda_init; the I term alone is gradient ascent on lambda).", ge=0)
    pid_kd: float = f(0.5, "pid: derivative gain on the RISE of J_C over pid_d_delay updates (a falling cost "
                      "adds nothing).", ge=0)
    pid_d_delay: int = f(4, "pid: updates back that the derivative compares J_C with (Algorithm 2 of Stooke et al.: "
                         "1; their code and omnisafe: 10).", gt=0)
    pid_ema_alpha: float = f(0.0, "pid: EMA weight of the past in the P and D inputs (rlpyt / omnisafe: 0.95); 0 = "
                             "none, as the J_C window already averages.", ge=0, le=0.99)
    cost_margin: float = f(0.0, "The dual update aims J_C at threshold - cost_margin (both rules), so that the "
                           "policy's swings around its target stay inside the budget J_C <= threshold; 0 = aim at "
                           "the threshold itself (Safe RLHF).", ge=0)


@dataclass(frozen=True)
class PIDGains:
    kp: float
    ki: float
    kd: float
    d_delay: int = 1
    ema_alpha: float = 0.0


@dataclass
class Multiplier:
    """lambda, clamped to [0, lambda_max], and a window of the last ``window`` costs (Safe-MM-DPO: sample
    costs of each estimate; Lagrangian PPO: each iteration's mean cost). ``pid`` None = the gradient rule
    on ``log_lambda``; else the PID rule on ``pid_state`` (``pid_lambda`` is its lambda)."""

    log_lambda: float
    threshold: float  # what the rule aims J_C at: the section's threshold - cost_margin (from_config)
    lr: float
    lambda_max: float
    window: int = 128
    costs: deque[float] = field(default_factory=deque)
    j_c: float | None = None  # mean of the window at the last update
    updates: int = 0
    pid: PIDGains | None = None
    pid_state: PIDState | None = None
    pid_lambda: float = 0.0

    def __post_init__(self) -> None:
        if self.pid is not None and self.pid_state is None:  # I starts at lambda_init (rlpyt: pid_i = penalty_init)
            self.pid_lambda = math.exp(self.log_lambda)
            self.pid_state = PIDState(self.pid_lambda)

    @classmethod
    def from_config(cls, section: Any, window: int) -> "Multiplier":
        """The multiplier a ``safe_dpo:`` / ``ppo_lag:`` section asks for (a :class:`DualConfig` with
        ``threshold``, ``lambda_init``, ``lambda_lr``, ``lambda_max``)."""
        pid = None
        if section.lambda_update == "pid":
            pid = PIDGains(section.pid_kp, section.pid_ki, section.pid_kd, section.pid_d_delay, section.pid_ema_alpha)
        return cls(math.log(section.lambda_init), section.threshold - section.cost_margin, section.lambda_lr,
                   section.lambda_max, window, pid=pid)

    @property
    def value(self) -> float:
        return math.exp(self.log_lambda) if self.pid is None else self.pid_lambda

    def update(self, costs: list[float]) -> None:
        """Add every rank's costs (identical on every rank), update on rank 0, broadcast. With no cost in
        the window yet (nothing scorable so far) lambda stays."""
        if comm.rank() == 0:
            self.costs.extend(costs)
            while len(self.costs) > self.window:
                self.costs.popleft()
            if self.costs:
                self.j_c = sum(self.costs) / len(self.costs)
                self._step(self.j_c)
                self.updates += 1
        self.load_state_dict(comm.broadcast_object(self.state_dict(), src=0))

    def _step(self, j_c: float) -> None:
        if self.pid is None:
            self.log_lambda = lagrange_update(self.log_lambda, j_c, threshold=self.threshold, lr=self.lr,
                                              lam_max=self.lambda_max)
            return
        g = self.pid
        assert self.pid_state is not None
        self.pid_lambda, self.pid_state = pid_lagrange_update(
            self.pid_state, j_c, threshold=self.threshold, kp=g.kp, ki=g.ki, kd=g.kd, lam_max=self.lambda_max,
            d_delay=g.d_delay, ema_alpha=g.ema_alpha)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cost_window": list(self.costs), "J_C": self.j_c, "updates": self.updates}
        if self.pid is None:
            return {"log_lambda": self.log_lambda, **out}
        assert self.pid_state is not None
        s = self.pid_state
        return {"lambda": self.pid_lambda, **out,
                "pid": {"integral": s.integral, "error_ema": s.error_ema, "cost_ema": s.cost_ema,
                        "history": list(s.history)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        # lambda as saved: a gradient checkpoint holds ln lambda, a pid one lambda itself
        lam = math.exp(float(state["log_lambda"])) if "log_lambda" in state else float(state["lambda"])
        if self.pid is None:
            self.log_lambda = float(state["log_lambda"]) if "log_lambda" in state else math.log(max(lam, LAMBDA_FLOOR))
        else:
            self.pid_lambda = lam
            pid = state.get("pid")  # absent: a gradient checkpoint; the integral takes over its lambda
            self.pid_state = PIDState(lam) if pid is None else PIDState(
                float(pid["integral"]), _opt_float(pid["error_ema"]), _opt_float(pid["cost_ema"]),
                tuple(float(c) for c in pid["history"]))
        # "costs": a ppo_lag checkpoint written before the two multipliers became this one
        self.costs = deque(float(c) for c in state.get("cost_window", state.get("costs", [])))
        self.j_c = _opt_float(state.get("J_C"))
        self.updates = int(state.get("updates", 0))


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)
