"""Batched multi-turn rollouts, token in, token out (``rollout/agents/render.py``).

Every still-running trajectory's next turn is generated in ONE call of the run's engine (``generate``); each
turn's ids are appended as generated (``loss_mask`` 1), the environment answers the decoded text
(``Environment.step``) and its reply's rendered ids are appended (``loss_mask`` 0). A trajectory ends when the
environment says done, after ``max_turns`` policy turns, or when its ids would pass ``max_total_tokens`` (then
``truncated``). Nothing here knows the model, the engine or the ranks: ``generate(prompts, max_new_tokens)`` is
the caller's. With the rows' sampling ``seeds`` (``rollout/seeds.py``) each turn's request carries its trajectory's
own seed of that turn (:func:`~alignkit.rollout.seeds.turn_seed`), so a trajectory samples the same turns on any
process and in any batch (colocated or on a separate placement's generators).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from alignkit.models.generation import Generations, Prompt
from alignkit.rollout.agents.env import Environment, EnvState
from alignkit.rollout.agents.render import MessageRenderer
from alignkit.rollout.seeds import turn_seed

Generate = Callable[[list[Any], int], Generations]  # token-id lists, or Prompts with seeds


@dataclass
class Trajectory:
    """One conversation: the opening ``prompt_ids``, then ``completion_ids`` (policy and environment ids in turn
    order) with ``loss_mask`` (1 on the policy's ids only) and ``sampler_logps`` (the engine's, 0 on environment
    ids; None when the engine reports none), per policy turn its ``rewards`` and ``turn_spans`` (start, end) in
    ``completion_ids``."""

    state: EnvState
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    sampler_logps: list[float] | None = None
    rewards: list[float] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    #: the row's sampling seed (None: the engine's global generator)
    seed: int | None = None

    @property
    def reward(self) -> float:
        """The trajectory's return: the sum of its turns' rewards (the last one is the final reward)."""
        return float(sum(self.rewards))


@dataclass
class Limits:
    """``max_turns`` policy turns, ``max_total_tokens`` completion ids (policy + environment) per trajectory,
    ``max_new_tokens`` per turn."""

    max_turns: int
    max_total_tokens: int
    max_new_tokens: int


def run_trajectories(env: Environment, renderer: MessageRenderer, rows: list[dict[str, Any]], generate: Generate,
                     limits: Limits, seconds: dict[str, float] | None = None,
                     seeds: list[int] | None = None) -> list[Trajectory]:
    """One trajectory per row, all generated together turn by turn; ``seconds`` gains ``env`` (the environment's
    steps and tools) and ``render`` (rendering and encoding its replies). ``seeds``: one per row (module
    docstring); None: ``generate`` gets plain token-id lists."""
    clock = seconds if seconds is not None else {}
    trajs = []
    for i, row in enumerate(rows):
        messages = env.reset(row)
        trajs.append(Trajectory(EnvState(row, list(messages)), renderer.prompt_ids(messages),
                                seed=None if seeds is None else seeds[i]))
    for turn in range(limits.max_turns):
        running = [t for t in trajs if not t.done]
        if not running:
            break
        budget = max(limits.max_total_tokens - len(t.completion_ids) for t in running)
        prompts: list[Any] = [t.prompt_ids + t.completion_ids if t.seed is None else
                              Prompt(t.prompt_ids + t.completion_ids, seed=turn_seed(t.seed, turn)) for t in running]
        gens = generate(prompts, min(limits.max_new_tokens, budget))
        for i, t in enumerate(running):
            logps = gens.logps[i] if gens.logps is not None else None
            _advance(t, gens.completion_ids[i], logps, env, renderer, limits, clock,
                     last=turn == limits.max_turns - 1)
    return trajs


def _advance(t: Trajectory, ids: list[int], logps: list[float] | None, env: Environment, renderer: MessageRenderer,
             limits: Limits, clock: dict[str, float], *, last: bool) -> None:
    room = limits.max_total_tokens - len(t.completion_ids)
    cut = len(ids) > room
    ids = list(ids[:room])
    start = len(t.completion_ids)
    _append(t, ids, 1.0, None if logps is None else list(logps[: len(ids)]))
    t.turn_spans.append((start, len(t.completion_ids)))
    text = renderer.tokenizer.decode(ids, skip_special_tokens=True)
    t.state.messages.append({"role": "assistant", "content": text})
    t.state.turn += 1
    began = time.perf_counter()
    result = env.step(t.state, text)
    clock["env"] = clock.get("env", 0.0) + time.perf_counter() - began
    t.rewards.append(float(result.reward))
    if result.done or cut or last:
        t.done, t.truncated = True, not result.done
        return
    began = time.perf_counter()
    reply = renderer.reply_ids(result.messages, ids)
    clock["render"] = clock.get("render", 0.0) + time.perf_counter() - began
    if len(t.completion_ids) + len(reply) >= limits.max_total_tokens:  # no room left for a policy token
        t.done = t.truncated = True
        return
    t.state.messages.extend(result.messages)
    _append(t, reply, 0.0, None if t.sampler_logps is None else [0.0] * len(reply))


def _append(t: Trajectory, ids: list[int], mask: float, logps: list[float] | None) -> None:
    t.completion_ids += ids
    t.loss_mask += [mask] * len(ids)
    if logps is not None:
        t.sampler_logps = (t.sampler_logps or [0.0] * (len(t.completion_ids) - len(ids))) + logps


def trajectory_counts(trajs: list[Trajectory]) -> Counter:
    """Tool calls by status, turns, trajectories and truncations of ``trajs`` (this rank's, to be summed)."""
    c: Counter = Counter()
    for t in trajs:
        c.update({f"tool_{k}": v for k, v in t.state.counts.items()})
        c.update(turns=len(t.turn_spans), trajectories=1, truncated=int(t.truncated),
                 policy_tokens=int(sum(t.loss_mask)), env_tokens=len(t.loss_mask) - int(sum(t.loss_mask)))
    return c
