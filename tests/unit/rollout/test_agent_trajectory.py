"""Batched multi-turn rollouts (issue 48, C) with a scripted policy: every running trajectory's next turn in one
generate call, policy ids kept as generated with loss_mask 1, environment ids with 0, the turn / token limits,
per-turn rewards; and the per-turn credit's hand-computed advantages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from alignkit.models.generation import Generations
from alignkit.rollout.advantages import GroupAdvantages
from alignkit.rollout.agents.calculator import CalculatorEnv
from alignkit.rollout.agents.credit import rewards_to_go, turn_advantages
from alignkit.rollout.agents.render import MessageRenderer
from alignkit.rollout.agents.trajectory import Limits, run_trajectories, trajectory_counts
from alignkit.rollout.seeds import turn_seed

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(micro_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(micro_model)


class Scripted:
    """Answers prompt i's trajectory with ``scripts[i][turn]`` (text + eos), recording each call's batch."""

    def __init__(self, tok: Any, scripts: dict[str, list[str]]) -> None:
        self.tok, self.scripts, self.calls = tok, scripts, []

    def __call__(self, prompts: list[list[int]], max_new: int) -> Generations:
        self.calls.append((len(prompts), max_new))
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            key = next(k for k in self.scripts if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            out.append(self.tok(self.scripts[key][turn], add_special_tokens=False)["input_ids"][:max_new]
                       + [self.tok.eos_token_id])
        return Generations(out, ["stop"] * len(out), [""] * len(out))


def rows() -> list[dict[str, Any]]:
    return [{"prompt": "What is 111*111?", "answer": "12321"}, {"prompt": "What is 222*222?", "answer": "49284"},
            {"prompt": "What is 333*333?", "answer": "110889"}]


def test_batched_turns_masks_and_rewards(tok: Any) -> None:
    env = CalculatorEnv()
    gen = Scripted(tok, {"111": ["12321"],                              # answers at once
                         "222": [CALL % "222*222", "49284"],            # one call, then the answer
                         "333": [CALL % "333*333", CALL % "1+", "7"]})  # a call, a failing one, a wrong answer
    seconds: dict[str, float] = {}
    trajs = run_trajectories(env, MessageRenderer(tok, env.schemas()), rows(), gen, Limits(4, 400, 64), seconds)
    assert gen.calls == [(3, 64), (2, 64), (1, 64)]  # every running trajectory's turn in one call
    assert [t.rewards for t in trajs] == [[1.0], [0.0, 1.0], [0.0, 0.0, 0.0]]
    assert [t.done and not t.truncated for t in trajs] == [True] * 3
    t = trajs[1]
    policy = [i for i, m in zip(t.completion_ids, t.loss_mask) if m == 1.0]
    assert tok.decode(policy) == CALL % "222*222" + "<|im_end|>" + "49284<|im_end|>"
    env_ids = t.completion_ids[t.turn_spans[0][1]:t.turn_spans[1][0]]
    assert set(t.loss_mask[t.turn_spans[0][1]:t.turn_spans[1][0]]) == {0.0}
    assert tok.decode(env_ids) == "\n<|im_start|>tool\n49284<|im_end|>\n<|im_start|>assistant\n"
    assert t.prompt_ids == MessageRenderer(tok, env.schemas()).prompt_ids([{"role": "user", "content": rows()[1]["prompt"]}])
    counts = trajectory_counts(trajs)
    assert (counts["tool_ok"], counts["tool_error"], counts["turns"], counts["trajectories"]) == (2, 1, 6, 3)
    assert set(seconds) == {"env", "render"}


def test_turn_and_token_limits_truncate(tok: Any) -> None:
    env = CalculatorEnv()
    gen = Scripted(tok, {"111": [CALL % "1+1"] * 9, "222": [CALL % "2+2"] * 9, "333": [CALL % "3+3"] * 9})
    trajs = run_trajectories(env, MessageRenderer(tok, None), rows(), gen, Limits(2, 400, 64))
    assert [len(t.turn_spans) for t in trajs] == [2, 2, 2] and all(t.truncated for t in trajs)
    assert all(t.loss_mask[-1] == 1.0 for t in trajs)  # ends on the policy's last turn, no dangling reply
    one_turn = len(tok(CALL % "1+1", add_special_tokens=False)["input_ids"]) + 1
    trajs = run_trajectories(env, MessageRenderer(tok, None), rows(), Scripted(tok, gen.scripts),
                             Limits(5, one_turn + 3, 64))
    assert [len(t.completion_ids) for t in trajs] == [one_turn] * 3  # the reply would pass the budget: stop
    assert all(t.truncated for t in trajs)
    short = Scripted(tok, gen.scripts)
    trajs = run_trajectories(env, MessageRenderer(tok, None), rows(), short, Limits(5, 10, 64))
    assert short.calls == [(3, 10)] and [len(t.completion_ids) for t in trajs] == [10] * 3


def test_turn_credit_by_hand() -> None:
    assert rewards_to_go([0.5, 0.0, 1.0]) == [1.5, 1.0, 1.0]
    rloo = GroupAdvantages("rloo", 2)
    returns = torch.tensor([1.5, 0.5, 1.0, 1.0], dtype=torch.float64)  # groups (1.5, 0.5), (1.0, 1.0)
    # trajectory 0: turns' rewards-to-go 1.5, 1.0, 1.0 against the other member's 0.5
    assert turn_advantages(rloo, returns, 0, [0.5, 0.0, 1.0]) == pytest.approx([1.0, 0.5, 0.5])
    grpo = GroupAdvantages("grpo", 2)
    # group (g, 0.5): A_0 = (g - m) / (std + 1e-4), m = (g + 0.5) / 2, std = |g - 0.5| / sqrt(2)
    expect = [(g - (g + 0.5) / 2) / (abs(g - 0.5) / 2 ** 0.5 + 1e-4) for g in (1.5, 1.0, 1.0)]
    assert turn_advantages(grpo, returns, 0, [0.5, 0.0, 1.0]) == pytest.approx(expect, rel=1e-6)
    # a final reward only: every turn gets the trajectory's advantage
    assert turn_advantages(grpo, returns, 0, [0.0, 1.5]) == pytest.approx([float(grpo(returns)[0])] * 2)


def test_each_turn_samples_from_its_trajectory_s_own_seed(tok: Any) -> None:
    """With the rows' seeds every request carries its trajectory's seed of that turn (the row's own first, then one
    derived per turn: rollout/seeds.py turn_seed), whichever other trajectories share the call: so a trajectory
    samples the same turns on a generator process as colocated, and its turns draw different numbers."""
    seen: list[list[int | None]] = []

    class Seeded(Scripted):
        def __call__(self, prompts: list[Any], max_new: int) -> Generations:
            seen.append([p.seed for p in prompts])
            return super().__call__([p.ids for p in prompts], max_new)

    scripts = {"111": ["12321"], "222": [CALL % "222*222", "49284"], "333": [CALL % "333*333", CALL % "1+", "7"]}
    env = CalculatorEnv()
    run_trajectories(env, MessageRenderer(tok, None), rows(), Seeded(tok, scripts), Limits(4, 400, 64),
                     seeds=[11, 22, 33])
    assert seen == [[11, 22, 33], [turn_seed(22, 1), turn_seed(33, 1)], [turn_seed(33, 2)]]
    assert len({33, turn_seed(33, 1), turn_seed(33, 2)}) == 3
    seen.clear()
    run_trajectories(env, MessageRenderer(tok, None), rows()[2:], Seeded(tok, scripts), Limits(4, 400, 64), seeds=[33])
    assert seen == [[33], [turn_seed(33, 1)], [turn_seed(33, 2)]]  # alone: the same seeds as in the batch of three
