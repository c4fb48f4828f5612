"""GRPO, RLOO and Dr. GRPO (ALGORITHMS 3): group-relative advantages, no critic.

Per iteration: the rewards of every completion of every rank (gathered in global order, groups
contiguous) -> the estimator by name (``grpo``: (r - mean_g) / (std + 1e-4) with ``scale_rewards``
group | batch | none; ``rloo``: leave-one-out baseline; ``dr_grpo``: r - mean_g) -> this rank's slice,
one advantage per completion shared by its tokens. Loss per token: the clipped surrogate (token or
sequence-level ratios, clip-higher with ``epsilon_high``) plus ``beta`` x the k3 KL to the reference
(a loss term, GRPO's form); aggregated by ``loss_aggregation`` (``sequence_mean``: GRPO's 1/|o_i|;
``token_mean``: DAPO; ``constant``: Dr. GRPO's sum / (sequences x max_new_tokens)) with the step's
global normaliser.

``rloo`` differs from TRL's RLOOTrainer (and the RLOO paper, Ahmadian et al. 2024) in where the KL goes:
TRL subtracts beta x the sequence's KL from each reward before the leave-one-out baseline (r_i - beta KL_i,
then A_i = r_i - mean_{j != i} r_j); here the leave-one-out advantage is of the reward alone and the KL is
GRPO's per-token k3 loss term. With ``beta: 0`` (the default) the two are the same.

With ``rollout.update_epochs: 1`` and ``rollout.mini_batches: 1`` the whole iteration is one
optimizer step, so the policy that sampled is the policy being updated: the old log-probs are the
current ones, detached (ratio 1, the clipping inactive), and the extra forward is skipped, as TRL does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from alignkit.algorithms.base import Batch, policy_specs, resolve_reference
from alignkit.algorithms.dynamic_sampling import dynamic_rollout
from alignkit.algorithms.online import Aggregation, OnlineAlgorithm
from alignkit.algorithms.reward import RewardConfig
from alignkit.algorithms.token_rollout import TokenRollout
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.errors import ConfigError
from alignkit.losses.kl import kl_estimate
from alignkit.losses.rl import aggregate, cispo_loss, clipped_surrogate
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models, ModelSpec
from alignkit.rewards.signals import Signal, nan_stats
from alignkit.rollout.advantages import GroupAdvantages, group_nanstd
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import Experience, RolloutContext
from alignkit.rollout.experience import Sample, flat, token_seq


@register_section("grpo")
@dataclass
class GRPOConfig:
    beta: float = f(0.0, "KL coefficient: + beta x KL(pi || pi_ref) per token in the loss (0 = no reference "
                    "model; TRL's default; DeepSeekMath used 0.04).", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = f("k3", "KL estimator of the loss term (k3: unbiased, >= 0).")
    epsilon: float = f(0.2, "Clip range: ratio in [1 - epsilon, 1 + epsilon_high].", gt=0)
    epsilon_high: Optional[float] = f(None, "Upper clip (DAPO clip-higher, e.g. 0.28); null = epsilon.", gt=0)
    scale_rewards: Literal["group", "batch", "none"] = f(
        "group", "grpo: divide the centred rewards by the group's std (group), the iteration's (batch) or not (none).")
    loss_aggregation: Aggregation = f(
        "auto", "sequence_mean (GRPO: mean over each completion's tokens, then over completions), token_mean "
        "(DAPO: over all tokens of the step), constant (Dr. GRPO: token sum / (completions x max_new_tokens)); "
        "auto = constant for dr_grpo, else sequence_mean. TRL's loss_type grpo / dapo (its default) / dr_grpo are "
        "sequence_mean / token_mean / constant; neither learned better on benchmarks/learn_grpo_vs_trl.py.")
    importance_sampling_level: Literal["token", "sequence"] = f(
        "token", "Importance ratio per token, or per sequence (GSPO: exp of the mean token log-ratio).")
    objective: Literal["clip", "cispo"] = f(
        "clip", "Policy loss: clip = the clipped surrogate (PPO / GRPO / DAPO); cispo = MiniMax-M1's CISPO, "
        "-sg(min(ratio, 1 + epsilon_high)) x A x logp: the importance weight clipped and detached on a REINFORCE "
        "term, so clipped tokens keep a gradient (no lower bound, as the paper and TRL's loss_type='cispo'; TRL's "
        "epsilon_high is the bound itself, here 1 + epsilon_high: TRL's 5.0 is epsilon_high 4.0). Token ratios.")
    overlong_buffer: int = f(
        0, "DAPO's overlong soft punishment: the last overlong_buffer tokens before rollout.max_new_tokens, where "
        "the reward gets a penalty rising linearly from 0 to -overlong_penalty (at max_new_tokens); 0 = off.", ge=0)
    overlong_penalty: float = f(1.0, "The penalty at rollout.max_new_tokens (DAPO's factor; with overlong_buffer).",
                                ge=0)
    dynamic_sampling: bool = f(
        False, "DAPO's dynamic sampling (grpo / rloo / dr_grpo): drop the groups whose rewards all agree (zero std: no "
        "advantage) and refill the batch with groups of fresh prompts, generating up to max_sampling_rounds extra "
        "rounds; the batch keeps its size (zero-std groups fill what the rounds did not find).")
    max_sampling_rounds: int = f(3, "Extra generation rounds per iteration with grpo.dynamic_sampling.", ge=0)
    reference: Literal["auto", "model", "lora_base"] = f(
        "auto", "Reference for the KL term (beta > 0): a frozen model (model.ref_name_or_path or the policy start) "
        "or the LoRA base with adapters off; auto = lora_base with model.lora.")

    def __post_init__(self) -> None:
        if self.objective == "cispo" and self.importance_sampling_level == "sequence":
            raise ConfigError("grpo.objective: cispo weights each token by its own ratio; set "
                              "grpo.importance_sampling_level: token (sequence ratios are GSPO's clipped objective)")


class GroupUpdate:
    """GRPO's update of the token ``policy`` as a part (built by GRPO / RLOO / Dr. GRPO and red-team RL): the
    forwards and group advantages of an experience (``advantages``: the algorithm's own estimator, groups, scale
    and clip), the clipped surrogate + KL loss of the ``grpo:`` section and its aggregation's loss units;
    ``tokens``: the algorithm's token part (temperature, sampler weights, log-prob forwards)."""

    def __init__(self, cfg: RunConfig, tokens: TokenRollout, advantages: GroupAdvantages) -> None:
        g = cfg.section(GRPOConfig)
        self.cfg, self.tokens, self.advantages = cfg, tokens, advantages
        self.reference = grpo_reference(cfg)
        self.aggregation = g.loss_aggregation if g.loss_aggregation != "auto" else (
            "constant" if advantages.estimator == "dr_grpo" else "sequence_mean")

    def experience(self, ctx: RolloutContext, samples: list[Sample], batches: list[Batch],
                   rewards: torch.Tensor) -> tuple[MetricSums, torch.Tensor]:
        """The forwards (reference log-probs with a reference; old log-probs when a later step's policy has moved),
        then :func:`group_experience` of the gathered ``rewards``: the statistics and the ``(global,)`` advantages."""
        ref = self.tokens.logps(ctx, batches, role="reference") if self.reference != "none" else None
        old = self.tokens.logps(ctx, batches) if self.tokens.updates_per_iteration > 1 else None
        return group_experience(samples, rewards, ctx.mine, self.advantages, ref_logps=ref, old_logps=old)

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        g = self.cfg.section(GRPOConfig)
        # at the sampler's temperature, with the exact entropy of softmax(logits / T) (algorithms/online.py)
        logps, entropy = models.logps("policy", batch, temperature=self.tokens.temperature, with_entropy=True)
        old = flat(batch, "old_logps") if "old_logps" in batch else logps.detach()
        seq, S = token_seq(batch), int(batch["response_lengths"].shape[0])
        # rollout.mask_truncated_completions: cut completions carry no loss and are out of the metrics (as TRL);
        # an agent's environment ids carry none and are out of GSPO's sequence ratio too
        keep = flat(batch, "loss_mask") if "loss_mask" in batch else torch.ones_like(logps)
        per_token, clipped = policy_loss(g, logps, old, flat(batch, "advantages"), seq, S, keep)
        m = MetricSums()
        per_token = per_token * self.tokens.sampler_weights(batch, old, keep, m)  # vLLM rollouts: pi_old / pi_vllm
        if "ref_logps" in batch:
            kl = kl_estimate(logps, flat(batch, "ref_logps"), g.kl_estimator)
            per_token = per_token + g.beta * kl
            m.add_masked_mean("kl", kl, keep)
        m.add_masked_mean("clip_fraction", clipped, keep)
        m.add_masked_mean("entropy", entropy, keep)  # exact entropy of the sampling distribution, token mean
        if "loss_mask" in batch:
            per_token = per_token * keep
        return aggregate(per_token, seq, S, mode=self.aggregation, normalizer=normalizer), m

    def units(self, batch: Batch) -> int:
        if self.aggregation == "token_mean":  # the trained tokens (all, or those loss_mask keeps)
            return int(batch["loss_mask"].sum()) if "loss_mask" in batch else int(batch["response_lengths"].sum())
        seqs = int(batch["response_lengths"].shape[0])
        return seqs * self.cfg.section(RolloutConfig).max_new_tokens if self.aggregation == "constant" else seqs


def policy_loss(g: GRPOConfig, logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor,
                num_seqs: int, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``grpo.objective``'s per-token loss and clipped flag, ``(N,)`` each (``keep``: the tokens a sequence-level
    ratio averages over)."""
    eps_high = g.epsilon_high or g.epsilon
    if g.objective == "cispo":  # no lower bound: eps_low 1 clamps at 0, below every ratio
        return cispo_loss(logps, old, advantages, eps_low=1.0, eps_high=eps_high)
    return clipped_surrogate(logps, old, advantages, eps_low=g.epsilon, eps_high=eps_high, seq=seq,
                             num_seqs=num_seqs, level=g.importance_sampling_level, mask=keep)


class GroupUpdated:
    """An online algorithm whose experience, loss and units are its ``group`` part's (:class:`GroupUpdate`): GRPO /
    RLOO / Dr. GRPO and red-team RL."""

    group: GroupUpdate

    def make_experience(self, ctx: RolloutContext, samples: list[Sample], batches: list[Batch],
                        scores: dict[str, torch.Tensor]) -> MetricSums:
        return self.group.experience(ctx, samples, batches, scores["reward"])[0]

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        return self.group.loss(models, batch, normalizer=normalizer)

    def units(self, batch: Batch) -> int:
        return self.group.units(batch)


class GroupRelative(GroupUpdated, OnlineAlgorithm):
    """``grpo`` / ``rloo`` / ``dr_grpo``: ``estimator`` names the advantage estimator (rollout/advantages.py); the
    update is the :class:`GroupUpdate` part."""

    estimator = "grpo"
    config_sections = ("grpo",)

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        g, G = cfg.section(GRPOConfig), cfg.section(RolloutConfig).num_generations
        advantages = GroupAdvantages(self.estimator, G, "none" if self.estimator == "dr_grpo" else g.scale_rewards)
        self.group = GroupUpdate(cfg, self.tokens, advantages)
        self.reference = self.group.reference

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        check_group_size(cfg, cls.estimator)
        buffer, max_new = cfg.section(GRPOConfig).overlong_buffer, cfg.section(RolloutConfig).max_new_tokens
        if buffer > max_new:
            raise ConfigError(f"grpo.overlong_buffer ({buffer}) must be at most rollout.max_new_tokens ({max_new}): "
                              "the penalty ramps over the last overlong_buffer tokens before the limit")

    @classmethod
    def default_rollout(cls, cfg: RunConfig) -> bool:
        return not cfg.section(GRPOConfig).dynamic_sampling  # DAPO's rounds draw more rows as they go

    def rollout(self, ctx: RolloutContext) -> Experience:
        """The default rollout, or with ``grpo.dynamic_sampling`` DAPO's rounds (algorithms/dynamic_sampling.py)."""
        g = self.cfg.section(GRPOConfig)
        if not g.dynamic_sampling:
            return super().rollout(ctx)
        ctx, samples, gens, scores, counts = dynamic_rollout(self, ctx, self.group.advantages.group_size,
                                                             g.max_sampling_rounds)
        experience = self.experience_of(ctx, samples, gens, ctx.batches(samples), scores)
        experience.stats.merge(counts)
        return experience

    def signals(self) -> dict[str, Signal]:
        """The ``reward`` signal with DAPO's overlong soft punishment (``grpo.overlong_*``) when it is on."""
        signals, g = super().signals(), self.cfg.section(GRPOConfig)
        signals["reward"].overlong = (g.overlong_buffer, g.overlong_penalty)
        return signals

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        specs = policy_specs(cfg, grpo_reference(cfg))
        if cfg.section(RewardConfig).model:
            specs.append(ModelSpec("reward", cfg.section(RewardConfig).model, "scalar"))
        return specs


def check_group_size(cfg: RunConfig, estimator: str) -> None:
    """One completion per prompt is its own group's mean: every advantage is 0 (rloo: no other completion to leave
    out), so a run would train nothing while reporting rewards."""
    if cfg.section(RolloutConfig).num_generations < 2:
        raise ConfigError(f"rollout.num_generations: 1 gives {estimator} zero advantages (each completion is "
                          "its own group's mean), so nothing would train; use 2 or more (e.g. 8), or algorithm: "
                          "ppo, whose learned value baseline works with one completion per prompt")


def grpo_reference(cfg: RunConfig) -> str:
    """The KL reference the ``grpo:`` section asks for (none at beta 0)."""
    g = cfg.section(GRPOConfig)
    return resolve_reference(cfg, g.reference, needed=g.beta > 0, key="grpo.reference")


def group_experience(samples: list[Sample], rewards: torch.Tensor, mine: slice, advantages: GroupAdvantages, *,
                     ref_logps: list[list[float]] | None = None,
                     old_logps: list[list[float]] | None = None) -> tuple[MetricSums, torch.Tensor]:
    """A group-relative experience from its inputs alone (no model, no process group): the ``advantages`` part's
    values of the ``(global,)`` gathered ``rewards`` (groups contiguous, the same on every rank), this rank's slice
    ``mine`` of them on its ``samples`` (one advantage per completion, on each of its tokens), and the given
    per-sample ``ref_logps`` / ``old_logps``; returns the iteration's statistics and the ``(global,)`` advantages."""
    adv = advantages(rewards)
    for s, a in zip(samples, adv[mine].tolist()):
        s["advantages"] = [a] * len(s["completion_ids"])
    for name, values in (("ref_logps", ref_logps), ("old_logps", old_logps)):
        for s, v in zip(samples, values or []):
            s[name] = v
    return group_stats(rewards, adv, advantages.group_size), adv


def group_stats(rewards: torch.Tensor, adv: torch.Tensor, group_size: int) -> MetricSums:
    """Iteration statistics from the gathered rewards and advantages (the same on every rank)."""
    m = MetricSums()
    mean, std, n = nan_stats(rewards)
    m.add("reward_std", std, 1)
    m.add("reward_scored", n / max(1, rewards.numel()), 1)
    m.add("frac_reward_zero_std", frac_zero_std(rewards, group_size), 1)
    m.add("advantage_mean", float(adv.mean()), 1)
    m.add("advantage_std", float(adv.std()) if adv.numel() > 1 else 0.0, 1)
    m.add("advantage_abs_max", float(adv.abs().max()), 1)
    return m


def frac_zero_std(rewards: torch.Tensor, group_size: int) -> float:
    """The fraction of groups of ``(P * G,)`` rewards (NaN = unscorable) whose std is zero, as TRL logs it
    (huggingface/trl f2cd577, trl/trainer/grpo_trainer.py L2690 and L2708: std_rewards = nanstd(rewards.view(-1,
    G), dim=1); is_std_zero = isclose(std_rewards, 0)). TRL's nanstd (trl/trainer/utils.py L873-880) is the
    Bessel-corrected std over a group's scored rewards and NaN when fewer than two are scored; isclose(NaN, 0)
    is False, so an all-NaN group or one with a single scored reward is NOT counted as zero-std. G = 1:
    TRL's std is 0 (every group is zero-std)."""
    if group_size == 1:
        return 1.0
    std = group_nanstd(rewards, group_size)  # (P,)
    return float(torch.isclose(std, torch.zeros_like(std)).double().mean())


class GRPO(GroupRelative):
    name = estimator = "grpo"


class RLOO(GroupRelative):
    name = estimator = "rloo"


class DrGRPO(GroupRelative):
    name = estimator = "dr_grpo"
