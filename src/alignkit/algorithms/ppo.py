"""PPO with a value head and GAE, and Lagrangian PPO (Safe RLHF) with a cost critic (ALGORITHMS 1.3, 4).

Experience per completion (this rank's samples): old and reference log-probs, the critic's values
V(s_t) at every completion token, per-token rewards r_t = -kl_coef * KL_t (k1 of the sampled tokens)
with the clipped sequence reward R added at the last token, GAE (gamma, lam) -> advantages and returns,
advantages whitened with the mean and variance of EVERY rank's tokens (one all-reduce).

``ppo_lag`` adds a cost signal (cost functions and / or a trained cost model, C > 0 = unsafe) with its
own critic (role ``cost_value``): per-token costs c_t = +kl_coef * KL_t with C at the last token, so
that A = (A_r - lambda A_c) / (1 + lambda) keeps the KL penalty at -kl_coef whatever lambda. lambda is
updated after each iteration from J_C, the mean cost of the last ``window`` iterations over all ranks:
ln lambda += lambda_lr * lambda * (J_C - threshold), clamped to lambda_max, computed on rank 0 and
broadcast; it is saved with checkpoints.

Loss per micro-batch: {policy: clipped surrogate, value: vf_coef x clipped value loss[, cost_value:
the same for the cost critic]}, each a token mean over the step's global completion tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from alignkit.algorithms.base import Batch, Context, MetricSums, policy_specs, resolve_reference
from alignkit.algorithms.lagrange import DualConfig, Multiplier
from alignkit.algorithms.online import OnlineAlgorithm, RolloutConfig
from alignkit.algorithms.reward import RewardConfig, RewardFunctionConfig
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.distributed import comm
from alignkit.errors import ConfigError
from alignkit.losses.kl import kl_estimate
from alignkit.losses.rl import aggregate, clipped_surrogate, clipped_value_loss
from alignkit.models.roles import Models, ModelSpec
from alignkit.rollout.advantages import gae, whiten
from alignkit.rollout.context import RolloutContext
from alignkit.rollout.experience import Sample, flat, per_sequence, token_seq
from alignkit.rollout.score import Scorer, nan_stats


@register_section("ppo")
@dataclass
class PPOConfig:
    kl_coef: float = f(0.05, "KL penalty per token in the reward: r_t = -kl_coef x (log pi - log pi_ref).", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = f("k1", "KL estimator of the reward penalty (k1: unbiased).")
    epsilon: float = f(0.2, "Policy clip range.", gt=0)
    epsilon_high: Optional[float] = f(None, "Upper policy clip; null = epsilon.", gt=0)
    value_clip: float = f(0.2, "Value clip range around the old values; 0 = unclipped.", ge=0)
    vf_coef: float = f(0.1, "Weight of the value loss (the critic's own optimizer steps it).", gt=0)
    gamma: float = f(1.0, "Discount.", ge=0, le=1)
    lam: float = f(0.95, "GAE lambda.", ge=0, le=1)
    whiten_advantages: bool = f(True, "Whiten advantages with the mean / std of every rank's tokens.")
    reward_clip: float = f(50.0, "Clip the sequence reward (and cost) to +-reward_clip.", gt=0)
    value_model: Optional[str] = f(None, "Critic initialisation (a causal LM or a reward model); null = the policy "
                                   "start (a fresh value head on it).")
    reference: Literal["auto", "model", "lora_base"] = f("auto", "Reference for the KL penalty; auto = lora_base with model.lora.")


@register_section("ppo_lag")
@dataclass
class PPOLagConfig(DualConfig):
    cost_functions: list[RewardFunctionConfig] = f([], "Cost functions with weights (builtin 'unsafe', or "
                                                   "'module:function'); C > 0 = unsafe.")
    cost_model: Optional[str] = f(None, "A trained cost model (a cost_model run's final dir).")
    threshold: float = f(0.0, "Cost limit d: the constraint is J_C <= threshold.")
    lambda_init: float = f(1.0, "Initial Lagrange multiplier.", gt=0)
    lambda_lr: float = f(0.05, "Dual step size of lambda_update gradient: ln lambda += lambda_lr * lambda * (J_C - "
                         "threshold).", ge=0)
    lambda_max: float = f(10.0, "Upper clamp of lambda.", gt=0)
    window: int = f(4, "Iterations whose mean cost make J_C.", gt=0)
    cost_value_model: Optional[str] = f(None, "Cost critic initialisation; null = ppo.value_model or the policy start.")


class PPO(OnlineAlgorithm):
    name = "ppo"
    constrained = False

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        self.reference = resolve_reference(cfg, cfg.section(PPOConfig).reference, needed=True, key="ppo.reference")
        lag = cfg.section(PPOLagConfig)
        if self.constrained and not (lag.cost_functions or lag.cost_model):
            raise ConfigError("ppo_lag: set ppo_lag.cost_functions or ppo_lag.cost_model (what the constraint limits)")
        # J_C = the mean cost of the last ``window`` iterations (one entry per iteration)
        self.multiplier = Multiplier.from_config(lag, lag.window)
        self._cost_mean = math.nan

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        m, p = cfg.model, cfg.section(PPOConfig)
        specs = policy_specs(cfg, resolve_reference(cfg, p.reference, needed=True, key="ppo.reference"))
        specs.insert(1, ModelSpec("value", p.value_model or m.name_or_path, "scalar", trainable=True))
        if cls.constrained:
            source = cfg.section(PPOLagConfig).cost_value_model or p.value_model or m.name_or_path
            specs.insert(2, ModelSpec("cost_value", source, "scalar", trainable=True))
            if cfg.section(PPOLagConfig).cost_model:
                specs.append(ModelSpec("cost", cfg.section(PPOLagConfig).cost_model, "scalar"))
        if cfg.section(RewardConfig).model:
            specs.append(ModelSpec("reward", cfg.section(RewardConfig).model, "scalar"))
        return specs

    def scorers(self) -> dict[str, Scorer]:
        out = super().scorers()
        if self.constrained:
            lag, ro = self.cfg.section(PPOLagConfig), self.cfg.section(RolloutConfig)
            out["cost"] = Scorer("cost", lag.cost_functions, model_role="cost" if lag.cost_model else None,
                                 max_new_tokens=ro.max_new_tokens, placement=self.cfg.section(RewardConfig).placement,
                                 **self.encoding())
        return out

    @property
    def lam(self) -> float:
        return self.multiplier.value

    # ------------------------------------------------------------------ experience
    def make_experience(self, ctx: RolloutContext, samples: list[Sample], batches: list[Batch],
                        scores: dict[str, torch.Tensor]) -> MetricSums:
        p = self.cfg.section(PPOConfig)
        old = self.token_logps(ctx, batches)
        ref = self.token_logps(ctx, batches, role="reference")
        m = MetricSums()
        kl_all: list[float] = []
        for s, o, r in zip(samples, old, ref):
            s["old_logps"], s["ref_logps"] = o, r
            s["kl"] = kl_estimate(torch.tensor(o), torch.tensor(r), p.kl_estimator).tolist()
            kl_all += s["kl"]
        signals = [("reward", "", "value", -1.0)] + ([("cost", "cost_", "cost_value", 1.0)] if self.constrained else [])
        for signal, prefix, critic, kl_sign in signals:
            values = self._values(ctx, critic, batches)
            seq_scores = scores[signal][ctx.mine].tolist()
            self._advantages(samples, values, seq_scores, prefix, kl_sign)
            stats = _whiten(samples, prefix + "advantages", enabled=p.whiten_advantages)
            m.add(f"{signal}_advantage_std_raw", stats, 1)
        if self.constrained:  # A = (A_r - lambda A_c) / (1 + lambda)
            lam = self.lam
            for s in samples:
                s["advantages"] = [(a - lam * c) / (1 + lam) for a, c in zip(s["advantages"], s["cost_advantages"])]
            self._cost_mean = nan_stats(scores["cost"])[0]
        mean, std, _ = nan_stats(scores["reward"])
        m.add("reward_std", std, 1)
        kl_sum = comm.all_reduce_sum(torch.tensor([sum(kl_all), len(kl_all)], dtype=torch.float64))
        m.add("kl", float(kl_sum[0]) / max(1.0, float(kl_sum[1])), 1)
        return m

    @torch.no_grad()
    def _values(self, ctx: RolloutContext, role: str, batches: list[Batch]) -> list[list[float]]:
        out: list[list[float]] = []
        for batch in batches:
            with ctx.strategy.autocast():
                out += per_sequence(ctx.models.values(role, batch), batch)
        return out

    def _advantages(self, samples: list[Sample], values: list[list[float]], seq_scores: list[float], prefix: str,
                    kl_sign: float) -> None:
        """GAE of one signal per sample: token rewards kl_sign x kl_coef x KL_t, the clipped sequence score
        at the last token; a NaN score (unscorable) masks the sample: advantage 0, returns = values."""
        p = self.cfg.section(PPOConfig)
        for s, v, score in zip(samples, values, seq_scores):
            s[prefix + "values"] = v
            if math.isnan(score):
                s[prefix + "advantages"], s[prefix + "returns"] = [0.0] * len(v), list(v)
                continue
            tok = torch.tensor([kl_sign * p.kl_coef * k for k in s["kl"]], dtype=torch.float32)
            tok[-1] += max(-p.reward_clip, min(p.reward_clip, score))
            vals = torch.tensor(v, dtype=torch.float32)
            adv, ret = gae(tok[None], vals[None], torch.ones_like(vals)[None], gamma=p.gamma, lam=p.lam)
            s[prefix + "advantages"], s[prefix + "returns"] = adv[0].tolist(), ret[0].tolist()

    # ------------------------------------------------------------------ update
    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[dict[str, torch.Tensor], MetricSums]:
        p = self.cfg.section(PPOConfig)
        logps = models.logps("policy", batch)
        seq, S = token_seq(batch), int(batch["response_lengths"].shape[0])
        per_token, clipped = clipped_surrogate(logps, flat(batch, "old_logps"), flat(batch, "advantages"),
                                               eps_low=p.epsilon, eps_high=p.epsilon_high or p.epsilon)
        losses = {"policy": aggregate(per_token, seq, S, mode="token_mean", normalizer=normalizer)}
        m = MetricSums()
        m.add_mean("clip_fraction", clipped)
        m.add_mean("entropy", -logps.detach())
        critics = [("value", "")] + ([("cost_value", "cost_")] if self.constrained else [])
        for role, prefix in critics:
            values = models.values(role, batch)
            vl = clipped_value_loss(values, flat(batch, prefix + "values"), flat(batch, prefix + "returns"),
                                    clip=p.value_clip)
            losses[role] = p.vf_coef * aggregate(vl, seq, S, mode="token_mean", normalizer=normalizer)
            m.add_mean(f"{role}_loss", vl.detach())
        return losses, m

    def units(self, batch: Batch) -> int:
        return int(batch["response_lengths"].sum())

    # ------------------------------------------------------------------ dual variable
    def on_step_end(self, ctx: Context) -> dict[str, float]:
        """After each iteration's updates: the dual step on the window of iteration mean costs."""
        if not self.constrained:
            return {}
        self.multiplier.update([] if math.isnan(self._cost_mean) else [self._cost_mean])
        j_c = self.multiplier.j_c
        return {"lambda": self.lam, "J_C": math.nan if j_c is None else j_c}

    def state_dict(self) -> dict[str, Any]:
        return self.multiplier.state_dict() if self.constrained else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.constrained:
            self.multiplier.load_state_dict(state)


def _whiten(samples: list[Sample], name: str, *, enabled: bool) -> float:
    """Whiten ``name`` over every token of every rank (one all-reduce); returns the raw std."""
    values = [v for s in samples for v in s[name]]
    stats = comm.all_reduce_sum(torch.tensor([sum(values), sum(v * v for v in values), len(values)],
                                             dtype=torch.float64))
    n = max(1.0, float(stats[2]))
    mean = float(stats[0]) / n
    var = max(0.0, float(stats[1]) / n - mean * mean)
    if enabled:
        for s in samples:
            s[name] = whiten(torch.tensor(s[name], dtype=torch.float64), mean, var).tolist()
    return math.sqrt(var)


class PPOLag(PPO):
    name = "ppo_lag"
    constrained = True
