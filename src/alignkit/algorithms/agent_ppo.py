"""PPO with a critic over multi-turn trajectories of a tool-using agent (``algorithm: ppo_agent``).

The rollout is ``grpo_agent``'s (``algorithms/agent.py``: the ``agent:`` section's environment, every running
trajectory's next turn in one engine call, token in, token out; a trajectory is one sample, ``loss_mask`` 1 on
the policy's ids only); the update is PPO's (``algorithms/ppo.py``, the ``ppo:`` section: value head, clipped
surrogate and value loss, KL penalty in the reward, whitening over every rank's policy ids). What differs is
the advantage (``rollout/agents/credit.py``): per-token rewards -kl_coef x KL_t on the policy's ids, each turn's
reward (clipped to +-``ppo.reward_clip``) added at the turn's LAST policy id, and GAE over the policy's ids only:
the environment's ids are not steps of the policy, the value at them is not trained and the policy id after an
environment reply bootstraps the one before it. ``ppo_lag`` has no agent form.
"""

from __future__ import annotations

from typing import Any

from alignkit.algorithms.agent import AgentConfig, AgentGRPO, agent_stats, check_agent_budget, open_environment
from alignkit.algorithms.ppo import PPO, PPOConfig
from alignkit.config.schema import RunConfig
from alignkit.rewards.signals import gather_scores
from alignkit.rollout.agents.credit import policy_token_gae, turn_token_rewards
from alignkit.rollout.agents.trajectory import Trajectory
from alignkit.rollout.context import Experience, LazyBatches, RolloutContext
from alignkit.rollout.experience import Sample


class AgentPPO(PPO):
    """``ppo_agent``: PPO's update on multi-turn trajectories of the ``agent:`` section's environment
    (``agent.estimator`` and ``agent.credit`` are the group estimators' and are not read: the critic credits)."""

    name = "ppo_agent"
    config_sections = ("ppo", "agent")
    # the agent's rollout, sample and greedy evaluation are grpo_agent's
    trajectories = AgentGRPO.trajectories
    run = AgentGRPO.run
    sample = AgentGRPO.sample
    evaluate = AgentGRPO.evaluate
    eval_sums = AgentGRPO.eval_sums
    eval_metrics = AgentGRPO.eval_metrics

    generator_items = AgentGRPO.generator_items

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        super().check_config(cfg)
        check_agent_budget(cfg)

    @classmethod
    def split_rollout(cls, cfg: RunConfig) -> str | None:
        """Split as grpo_agent's under ``placement: separate``: the generators run the environments and the turns
        (:meth:`generator_items`) and send the finished trajectories; the critic stays on the trainers, whose
        :meth:`make_experience` takes the values (and old / reference log-probs) of the received token ids."""
        return "items"

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        a = self.agent = cfg.section(AgentConfig)
        self.env, self.renderer = open_environment(self, a, tokenizer)

    def rollout(self, ctx: RolloutContext) -> Experience:
        trajs, seconds = self.trajectories(ctx)
        samples = [self.agent_sample(t) for t in trajs]
        scores = {"reward": gather_scores({"total": [t.reward for t in trajs]})["total"]}
        with ctx.timed("experience"):
            stats = self.make_experience(ctx, samples, LazyBatches(lambda: ctx.batches(samples)), scores)
        agent_stats(stats, trajs, scores["reward"], seconds)
        return Experience(samples, scores, stats)

    def agent_sample(self, t: Trajectory) -> Sample:
        """``sample(t)`` with the per-token ``turn_rewards`` (turn k's reward, clipped, at its last policy id)."""
        clip = self.cfg.section(PPOConfig).reward_clip
        s = self.sample(t)
        s["turn_rewards"] = turn_token_rewards(len(t.completion_ids), t.turn_spans,
                                               [max(-clip, min(clip, r)) for r in t.rewards])
        return s

    def _advantages(self, samples: list[Sample], values: list[list[float]], seq_scores: list[float],
                    scored: list[bool], prefix: str, kl_sign: float) -> None:
        """GAE per trajectory over its policy ids (``loss_mask`` 1; a truncated trajectory masked by
        ``rollout.mask_truncated_completions`` has none and gets advantage 0): token rewards -kl_coef x KL_t plus
        the turn rewards. ``seq_scores`` (the returns) are already in ``turn_rewards``; every return is a number."""
        p = self.cfg.section(PPOConfig)
        for s, v in zip(samples, values):
            rewards = [kl_sign * p.kl_coef * k + r for k, r in zip(s["kl"], s["turn_rewards"])]
            s[prefix + "values"] = v
            s[prefix + "advantages"], s[prefix + "returns"] = policy_token_gae(rewards, v, s["loss_mask"],
                                                                                gamma=p.gamma, lam=p.lam)
