"""GRPO / RLOO / Dr. GRPO over multi-turn trajectories of a tool-using agent (``algorithm: grpo_agent``).

The rollout is the algorithm's (ARCHITECTURE 7b / 7c): per iteration every prompt row opens a trajectory in the
``agent.env`` environment; all still-running trajectories take their next turn in ONE engine call
(``rollout/agents/trajectory.py``), token in, token out (``rollout/agents/render.py``). A trajectory is ONE
sample: its ``completion_ids`` hold the policy's and the environment's ids in turn order, ``loss_mask`` 1 on the
policy's only. Its return (the sum of its turn rewards, the last being the final reward) is gathered from every
rank in global order, so every rank computes the same group advantages (``agent.estimator``, ``agent.credit``);
the update is GRPO's (``GroupUpdate``: the ``grpo:`` section), whose loss already multiplies by ``loss_mask``.
``grpo.loss_aggregation: auto`` is ``token_mean`` here (``constant`` for dr_grpo): ``sequence_mean`` would divide a
trajectory's loss by all its ids, the environment's too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from alignkit.algorithms.base import Batch
from alignkit.algorithms.grpo import GroupRelative, GRPOConfig
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.distributed import comm
from alignkit.errors import ConfigError
from alignkit.metrics import MetricSums
from alignkit.rewards.signals import gather_scores
from alignkit.rollout.agents import calculator  # noqa: F401  (registers the shipped environment)
from alignkit.rollout.agents.credit import turn_advantages, turn_token_values
from alignkit.rollout.agents.env import ENVIRONMENTS
from alignkit.rollout.agents.parsers import TOOL_CALL_PARSERS
from alignkit.rollout.agents.render import MessageRenderer
from alignkit.rollout.agents.trajectory import Limits, Trajectory, run_trajectories, trajectory_counts
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import Experience, LazyBatches, RolloutContext
from alignkit.rollout.experience import Sample
from alignkit.rollout.seeds import with_stream


@register_section("agent")
@dataclass
class AgentConfig:
    env: str = f("calculator", "Environment by name (rollout/agents: calculator; or one a plugin registers with "
                 "register_environment).")
    max_turns: int = f(4, "Policy turns per trajectory at most; a trajectory still running then is truncated.", gt=0)
    max_total_tokens: int = f(256, "Completion ids (policy + environment) per trajectory at most; a turn that "
                              "would pass it is cut and the trajectory truncated.", gt=0)
    env_args: dict[str, Any] = f({}, "Settings of the environment (a mapping passed to its constructor: "
                                 "Environment.settings); calculator: {tool: calculator | calc}.")
    tool_call_parser: str = f("hermes", "How tool calls are read from the policy's text: hermes = "
                              "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Hermes, Qwen).")
    tool_timeout_s: float = f(5.0, "A tool call running longer is answered with a timeout message.", gt=0)
    estimator: Literal["grpo", "rloo", "dr_grpo"] = f("grpo", "Group advantage estimator over trajectory returns.")
    credit: Literal["trajectory", "turn"] = f(
        "trajectory", "trajectory: every policy token gets its trajectory's advantage; turn: a turn's tokens get "
        "the advantage of its reward-to-go (the rewards at or after it).")

    def __post_init__(self) -> None:  # an unknown name: one line with the closest (plugins are imported first)
        ENVIRONMENTS.get(self.env)
        TOOL_CALL_PARSERS.get(self.tool_call_parser)


def check_agent_budget(cfg: RunConfig) -> None:
    """A trajectory's token budget must hold at least one whole policy turn: with ``agent.max_total_tokens`` below
    ``rollout.max_new_tokens`` the first turn would be cut at the trajectory's budget, silently."""
    total, turn = cfg.section(AgentConfig).max_total_tokens, cfg.section(RolloutConfig).max_new_tokens
    if total < turn:
        raise ConfigError(f"agent.max_total_tokens ({total}) is below rollout.max_new_tokens ({turn}), the tokens of "
                          "one policy turn: a trajectory could not hold its first turn; raise agent.max_total_tokens "
                          "or lower rollout.max_new_tokens")


def open_environment(algo: Any, a: AgentConfig, tokenizer: Any) -> tuple[Any, MessageRenderer]:
    """The ``agent:`` section's environment and its renderer (tools' schemas to the chat template); the
    algorithm's prompt rows must then carry the environment's ``row_fields`` (checked as the data is read)."""
    env = ENVIRONMENTS.get(a.env)(a.env_args, tool_timeout_s=a.tool_timeout_s, tool_call_parser=a.tool_call_parser)
    algo.data.required = env.row_fields
    return env, MessageRenderer(tokenizer, env.schemas())


class AgentGRPO(GroupRelative):
    """``grpo_agent``: GRPO's update on multi-turn trajectories of the ``agent:`` section's environment."""

    name = "grpo_agent"
    config_sections = ("grpo", "agent")
    eval_sums = ("turns", "tool_ok", "tool_calls")

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        a = cfg.section(AgentConfig)
        self.estimator = a.estimator  # read by GroupRelative's constructor
        super().__init__(cfg, tokenizer)
        self.agent = a
        if cfg.section(GRPOConfig).loss_aggregation == "auto" and a.estimator != "dr_grpo":
            self.group.aggregation = "token_mean"  # sequence_mean would count the environment's ids
        self.env, self.renderer = open_environment(self, a, tokenizer)

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        super().check_config(cfg)
        check_agent_budget(cfg)

    @classmethod
    def split_rollout(cls, cfg: RunConfig) -> str | None:
        """Under ``placement: separate`` the generators run the environments and the turns (:meth:`generator_items`)."""
        return "items"

    def generator_items(self, rows: list[dict[str, Any]], seeds: list[int], generate: Any,
                        seconds: dict[str, float]) -> list[Any]:
        """A generator's trajectories of ``rows`` (the trainers' :meth:`trajectories` receives them)."""
        max_new = self.cfg.section(RolloutConfig).max_new_tokens
        return self.run(rows, seeds, generate, max_new, seconds)

    def run(self, rows: list[dict[str, Any]], seeds: list[int] | None, generate: Any, max_new_tokens: int,
            seconds: dict[str, float]) -> list[Trajectory]:
        """One trajectory per prompt row, every turn sampled by ``generate(prompts, max_new_tokens)`` (``seeds``:
        the rows' sampling seeds, each turn's derived from them; ``rollout/agents/trajectory.py``)."""
        a = self.agent
        limits = Limits(a.max_turns, a.max_total_tokens, max_new_tokens)
        rows = [{"prompt": r["prompt"], **r["fields"]} for r in rows]
        return run_trajectories(self.env, self.renderer, rows, generate, limits, seconds, seeds)

    def trajectories(self, ctx: RolloutContext) -> tuple[list[Trajectory], dict[str, float]]:
        """One trajectory per row of ``ctx.rows``, sampled with ``ctx.params`` (:meth:`RolloutContext.items`), and
        the seconds by phase of where they were made."""

        def generate(prompts: list[Any], max_new: int) -> Any:
            return ctx.generate("policy", prompts, replace(ctx.params, max_new_tokens=max_new))

        def make() -> tuple[list[Trajectory], dict[str, float]]:
            seeds = None if ctx.seeds is None else with_stream(ctx.seeds, "policy")
            return self.run(ctx.rows, seeds, generate, ctx.params.max_new_tokens, ctx.seconds), ctx.seconds

        return ctx.items(make)

    def rollout(self, ctx: RolloutContext) -> Experience:
        trajs, seconds = self.trajectories(ctx)
        samples = [self.sample(t) for t in trajs]
        scores = {"reward": gather_scores({"total": [t.reward for t in trajs]})["total"]}
        with ctx.timed("experience"):
            stats, _ = self.group.experience(ctx, samples, LazyBatches(lambda: ctx.batches(samples)),
                                               scores["reward"])
        if self.agent.credit == "turn":
            for k, (s, t) in enumerate(zip(samples, trajs)):
                per_turn = turn_advantages(self.group.advantages, scores["reward"], ctx.mine.start + k, t.rewards)
                s["advantages"] = turn_token_values(t, per_turn)
        agent_stats(stats, trajs, scores["reward"], seconds)
        return Experience(samples, scores, stats)

    def sample(self, t: Trajectory) -> Sample:
        s: Sample = {"prompt_ids": t.prompt_ids, "completion_ids": t.completion_ids, "loss_mask": list(t.loss_mask),
                     "prompt": t.state.row["prompt"], "completion": self.tokenizer.decode(t.completion_ids)}
        if t.truncated and self.cfg.section(RolloutConfig).mask_truncated_completions:
            s["loss_mask"] = [0.0] * len(t.loss_mask)
        if t.sampler_logps is not None and self.tokens.importance_sampling() is not None:
            s["sampler_logps"] = t.sampler_logps
        return s

    def make_experience(self, ctx: RolloutContext, samples: list[Sample], batches: list[Batch],
                        scores: dict[str, torch.Tensor]) -> MetricSums:
        return self.group.experience(ctx, samples, batches, scores["reward"])[0]

    @torch.no_grad()
    def evaluate(self, ctx: RolloutContext) -> tuple[float, ...]:
        """Trajectories of ``ctx.rows`` (this rank's; greedy, or sampled from ``ctx.seeds``): (sum of their returns,
        how many, completion ids, then the :attr:`eval_sums`: turns, valid tool calls, tool calls)."""
        trajs, _ = self.trajectories(ctx)
        c = trajectory_counts(trajs)
        return (sum(t.reward for t in trajs), float(len(trajs)), float(sum(len(t.completion_ids) for t in trajs)),
                float(c["turns"]), float(c["tool_ok"]), float(tool_calls(c)))

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Turns per trajectory and tool-call validity (valid calls / calls; 0 without calls) of an evaluation."""
        return {"turns": sums["turns"] / max(1.0, sums["scored"]), "tool_valid": validity(sums["tool_ok"], sums["tool_calls"])}


#: the per-trajectory counts summed over ranks into the metrics
_COUNTS = ("trajectories", "turns", "truncated", "policy_tokens", "env_tokens", *(
    f"tool_{s}" for s in ("ok", "malformed", "unknown_tool", "bad_arguments", "error", "timeout")))


def tool_calls(counts: Mapping[str, float]) -> float:
    """The tool calls of trajectory counts: every ``tool_<status>`` (ok or not)."""
    return sum(v for k, v in counts.items() if k.startswith("tool_"))


def validity(ok: float, calls: float) -> float:
    """Tool-call validity: valid calls / calls, 0 without calls."""
    return ok / calls if calls else 0.0


def agent_stats(stats: MetricSums, trajs: list[Trajectory], rewards: torch.Tensor, seconds: dict[str, float]) -> None:
    """Iteration metrics over every rank: reward mean, turns per trajectory, tool calls by status per trajectory,
    tool-call validity (ok / calls), truncation, the environment's share of the ids, and this rank's share of the
    rollout time spent in the environment and in rendering its replies."""
    c: Counter = trajectory_counts(trajs)
    total = comm.all_reduce_sum(torch.tensor([float(c[k]) for k in _COUNTS], dtype=torch.float64))
    n = dict(zip(_COUNTS, total.tolist()))
    per = max(1.0, n["trajectories"])
    calls = tool_calls(n)
    stats.add("reward_mean", float(rewards.mean()), 1)
    stats.add("agent/turns", n["turns"] / per, 1)
    stats.add("agent/tool_calls", calls / per, 1)
    stats.add("agent/tool_valid", validity(n["tool_ok"], calls), 1)
    for k in _COUNTS[5:]:
        stats.add(f"agent/{k}", n[k] / per, 1)
    stats.add("agent/truncated", n["truncated"] / per, 1)
    stats.add("agent/env_token_fraction", n["env_tokens"] / max(1.0, n["env_tokens"] + n["policy_tokens"]), 1)
    stats.add("completion_length", (n["env_tokens"] + n["policy_tokens"]) / per, 1)
    busy = sum(seconds.get(k, 0.0) for k in ("generate", "env", "render")) or 1.0
    stats.add("agent/env_time_share", seconds.get("env", 0.0) / busy, 1)
    stats.add("agent/render_time_share", seconds.get("render", 0.0) / busy, 1)
