"""The one Lagrange multiplier of a cost constraint J_C <= d, used by Safe-MM-DPO and Lagrangian PPO
(Safe RLHF, ALGORITHMS 1.3).

:class:`Multiplier` holds ln lambda and a window of recent costs; :meth:`Multiplier.update` takes the
costs of every rank (the same list on every rank), lets rank 0 apply ``lagrange_update`` to the
window mean and broadcasts rank 0's state, so every rank holds the same lambda and window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from alignkit.distributed import comm
from alignkit.losses.safe_dpo import lagrange_update


@dataclass
class Multiplier:
    """ln lambda, clamped above at ln lambda_max, and a window of the last ``window`` costs (Safe-MM-DPO:
    sample costs of each estimate; Lagrangian PPO: each iteration's mean cost)."""

    log_lambda: float
    threshold: float
    lr: float
    lambda_max: float
    window: int = 128
    costs: deque[float] = field(default_factory=deque)
    j_c: float | None = None  # mean of the window at the last update
    updates: int = 0

    @property
    def value(self) -> float:
        return math.exp(self.log_lambda)

    def update(self, costs: list[float]) -> None:
        """Add every rank's costs (identical on every rank), update on rank 0, broadcast. With no cost in
        the window yet (nothing scorable so far) lambda stays."""
        if comm.rank() == 0:
            self.costs.extend(costs)
            while len(self.costs) > self.window:
                self.costs.popleft()
            if self.costs:
                self.j_c = sum(self.costs) / len(self.costs)
                self.log_lambda = lagrange_update(self.log_lambda, self.j_c, threshold=self.threshold, lr=self.lr,
                                                  lam_max=self.lambda_max)
                self.updates += 1
        self.load_state_dict(comm.broadcast_object(self.state_dict(), src=0))

    def state_dict(self) -> dict[str, Any]:
        return {"log_lambda": self.log_lambda, "cost_window": list(self.costs), "J_C": self.j_c,
                "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.log_lambda = float(state["log_lambda"])
        # "costs": a ppo_lag checkpoint written before the two multipliers became this one
        self.costs = deque(float(c) for c in state.get("cost_window", state.get("costs", [])))
        j_c = state.get("J_C")
        self.j_c = None if j_c is None else float(j_c)
        self.updates = int(state.get("updates", 0))
