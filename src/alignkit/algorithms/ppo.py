"""PPO with a value head and GAE, and Lagrangian PPO (Safe RLHF) with a cost critic (ALGORITHMS 1.3, 4).

Experience per completion (this rank's samples): old and reference log-probs, the critic's values
V(s_t) at every completion token, per-token rewards r_t = -kl_coef * KL_t (k1 of the sampled tokens)
with the clipped sequence reward R added at the last token, GAE (gamma, lam) -> advantages and returns.
The advantage the policy trains on is whitened with the mean and variance of EVERY rank's scorable
tokens (one all-reduce). A completion that a signal could not score (NaN) is unscorable: ``loss_mask``
0 on its tokens, advantage 0 (before and after whitening), left out of the whitening statistics, and
it adds nothing to the policy or value losses nor to their normaliser (:meth:`PPO.units`).

``ppo_lag`` adds a cost signal (cost functions and / or a trained cost model, C > 0 = unsafe) with its
own critic (role ``cost_value``): per-token costs c_t = +kl_coef * KL_t with C at the last token. The
RAW GAE advantages are combined first, A = (A_r - lambda A_c) / (1 + lambda) (Safe RLHF's actor
advantage), and only A is whitened: reward and cost weigh 1 : lambda, and since GAE is linear in the
token rewards, A is the GAE of (r_t - lambda c_t) / (1 + lambda), whose KL part is -kl_coef * KL_t
whatever lambda. lambda is updated after each iteration from J_C, the mean cost of the last ``window``
iterations over all ranks: ln lambda += lambda_lr * lambda * (J_C - threshold), clamped to lambda_max,
computed on rank 0 and broadcast; it is saved with checkpoints.

Loss per micro-batch: {policy: clipped surrogate, value: vf_coef x clipped value loss[, cost_value:
the same for the cost critic]}, each a token mean over the step's global scorable completion tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from alignkit.algorithms.base import Batch, Context, policy_specs, resolve_reference
from alignkit.algorithms.lagrange import DualConfig, Multiplier
from alignkit.algorithms.online import OnlineAlgorithm
from alignkit.algorithms.reward import RewardConfig, RewardFunctionConfig
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.distributed import comm
from alignkit.errors import ConfigError
from alignkit.losses.kl import kl_estimate
from alignkit.losses.rl import aggregate, clipped_surrogate, clipped_value_loss
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models, ModelSpec
from alignkit.rewards.signals import Signal, nan_stats
from alignkit.rollout.advantages import gae, whiten
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import Experience, RolloutContext
from alignkit.rollout.experience import Sample, flat, per_sequence, token_seq


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
    whiten_advantages: bool = f(True, "Whiten the advantage the policy trains on (ppo_lag: the combined one) with "
                                "the mean / std of every rank's scorable tokens.")
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
    #: the critics' old values and GAE returns (``cost_``: ppo_lag's cost critic) beside the shared fields
    token_fields = (*OnlineAlgorithm.token_fields, "returns", "values", "cost_advantages", "cost_returns", "cost_values")

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        self.reference = resolve_reference(cfg, cfg.section(PPOConfig).reference, needed=True, key="ppo.reference")
        lag = cfg.section(PPOLagConfig)
        if self.constrained and not (lag.cost_functions or lag.cost_model):
            raise ConfigError("ppo_lag: set ppo_lag.cost_functions or ppo_lag.cost_model (what the constraint limits)")
        # J_C = the mean cost of the last ``window`` iterations (one entry per iteration)
        self.multiplier = Multiplier.from_config(lag, lag.window)

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

    def signals(self) -> dict[str, Signal]:
        out = super().signals()
        if self.constrained:
            lag, ro = self.cfg.section(PPOLagConfig), self.cfg.section(RolloutConfig)
            out["cost"] = Signal("cost", lag.cost_functions, model_role="cost" if lag.cost_model else None,
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
        old = self.tokens.logps(ctx, batches)
        ref = self.tokens.logps(ctx, batches, role="reference")
        m = MetricSums()
        for s, o, r in zip(samples, old, ref):
            s["old_logps"], s["ref_logps"] = o, r
            s["kl"] = kl_estimate(torch.tensor(o), torch.tensor(r), p.kl_estimator).tolist()
        signals = [("reward", "", "value", -1.0)] + ([("cost", "cost_", "cost_value", 1.0)] if self.constrained else [])
        # scorable = every signal scored the completion; the others carry loss_mask 0 (no gradient, not counted)
        scored = torch.stack([~torch.isnan(scores[sig][ctx.mine]) for sig, *_ in signals]).all(0).tolist()
        for s, ok in zip(samples, scored):  # times the rollout's own mask (mask_truncated_completions)
            s["loss_mask"] = [float(ok) * k for k in s.get("loss_mask", [1.0] * len(s["completion_ids"]))]
        for signal, prefix, critic, kl_sign in signals:
            values = self._values(ctx, critic, batches)
            self._advantages(samples, values, scores[signal][ctx.mine].tolist(), scored, prefix, kl_sign)
        names = ["advantages"]
        if self.constrained:  # A = (A_r - lambda A_c) / (1 + lambda) on the RAW GAE advantages (ALGORITHMS 1.3)
            lam = self.lam
            for s in samples:
                s["reward_advantages"] = s["advantages"]
                s["advantages"] = [(a - lam * c) / (1 + lam) for a, c in zip(s["advantages"], s["cost_advantages"])]
            names = ["advantages", "reward_advantages", "cost_advantages"]
        moments = token_moments(samples, names)  # one all-reduce over every rank's scorable tokens
        if p.whiten_advantages:  # whiten once: the advantage the policy trains on
            whiten_tokens(samples, "advantages", *moments["advantages"])
        for signal, name in zip(("reward", "cost"), names[-len(signals):]):
            m.add(f"{signal}_advantage_std_raw", math.sqrt(moments[name][1]), 1)
        mean, std, _ = nan_stats(scores["reward"])
        m.add("reward_std", std, 1)
        m.add("kl", masked_token_mean(samples, "kl"), 1)
        return m

    @torch.no_grad()
    def _values(self, ctx: RolloutContext, role: str, batches: list[Batch]) -> list[list[float]]:
        out: list[list[float]] = []
        for batch in batches:
            with ctx.strategy.autocast():
                out += per_sequence(ctx.models.values(role, batch), batch)
        return out

    def _advantages(self, samples: list[Sample], values: list[list[float]], seq_scores: list[float],
                    scored: list[bool], prefix: str, kl_sign: float) -> None:
        """GAE of one signal per sample: token rewards kl_sign x kl_coef x KL_t, the clipped sequence score
        at the last token; an unscorable sample (``scored`` False: a NaN in any signal) gets advantage 0 and
        returns = values (its ``loss_mask`` keeps it out of the losses)."""
        p = self.cfg.section(PPOConfig)
        for s, v, score, ok in zip(samples, values, seq_scores, scored):
            s[prefix + "values"] = v
            if not ok:
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
        # at the sampler's temperature, with the exact entropy of softmax(logits / T) (algorithms/online.py)
        logps, entropy = models.logps("policy", batch, temperature=self.tokens.temperature, with_entropy=True)
        seq, S = token_seq(batch), int(batch["response_lengths"].shape[0])
        per_token, clipped = clipped_surrogate(logps, flat(batch, "old_logps"), flat(batch, "advantages"),
                                               eps_low=p.epsilon, eps_high=p.epsilon_high or p.epsilon)
        keep = flat(batch, "loss_mask")  # (N,) 0 on unscorable samples' tokens: no gradient, not in units()
        m = MetricSums()
        per_token = per_token * self.tokens.sampler_weights(batch, flat(batch, "old_logps"), keep, m)  # vLLM: pi_old / pi_vllm
        losses = {"policy": aggregate(per_token * keep, seq, S, mode="token_mean", normalizer=normalizer)}
        # over the trained tokens: an unscorable sample's tokens are out of the metrics as of the loss
        m.add_masked_mean("clip_fraction", clipped, keep)
        m.add_masked_mean("entropy", entropy, keep)  # exact entropy of the sampling distribution, token mean
        critics = [("value", "")] + ([("cost_value", "cost_")] if self.constrained else [])
        for role, prefix in critics:
            values = models.values(role, batch)
            vl = clipped_value_loss(values, flat(batch, prefix + "values"), flat(batch, prefix + "returns"),
                                    clip=p.value_clip)
            losses[role] = p.vf_coef * aggregate(vl * keep, seq, S, mode="token_mean", normalizer=normalizer)
            m.add_masked_mean(f"{role}_loss", vl, keep)
        return losses, m

    def units(self, batch: Batch) -> int:
        """The micro-batch's scorable completion tokens (``loss_mask`` 1): the step loss is their mean."""
        return int(batch["loss_mask"].sum())

    # ------------------------------------------------------------------ dual variable
    def on_iteration_end(self, ctx: Context, experience: Experience) -> dict[str, float]:
        """After each iteration's updates: the dual step on the window of iteration mean costs (this iteration's:
        the mean of the experience's gathered costs, NaN ones left out; none when every cost is NaN)."""
        if not self.constrained:
            return self.on_step_end(ctx)
        cost_mean = nan_stats(experience.scores["cost"])[0]
        self.multiplier.update([] if math.isnan(cost_mean) else [cost_mean])
        j_c = self.multiplier.j_c
        return {"lambda": self.lam, "J_C": math.nan if j_c is None else j_c}

    def state_dict(self) -> dict[str, Any]:
        return self.multiplier.state_dict() if self.constrained else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.constrained:
            self.multiplier.load_state_dict(state)


def masked_token_mean(samples: list[Sample], name: str) -> float:
    """The mean of per-token field ``name`` over every rank's tokens with ``loss_mask`` > 0 (the trained tokens, as
    GRPO's loss logs its kl: an agent's policy ids, not the environment's), in one all-reduce (0 without any)."""
    kept = [v for s in samples for v, k in zip(s[name], s["loss_mask"]) if k > 0]
    total = comm.all_reduce_sum(torch.tensor([sum(kept), len(kept)], dtype=torch.float64))
    return float(total[0]) / max(1.0, float(total[1]))


def token_moments(samples: list[Sample], names: list[str]) -> dict[str, tuple[float, float]]:
    """Mean and (biased) variance of each per-token field in ``names`` over the tokens with ``loss_mask`` 1
    of every rank's samples, in ONE all-reduce of [sum_x, sum_x^2 per name..., count] (float64)."""
    keep = [[k > 0 for k in s["loss_mask"]] for s in samples]
    sums: list[float] = []
    n = 0
    for name in names:
        values = [v for s, k in zip(samples, keep) for v, ok in zip(s[name], k) if ok]
        sums += [sum(values), sum(v * v for v in values)]
        n = len(values)
    stats = comm.all_reduce_sum(torch.tensor(sums + [n], dtype=torch.float64))
    count = max(1.0, float(stats[-1]))
    out: dict[str, tuple[float, float]] = {}
    for i, name in enumerate(names):
        mean = float(stats[2 * i]) / count
        out[name] = (mean, max(0.0, float(stats[2 * i + 1]) / count - mean * mean))
    return out


def whiten_tokens(samples: list[Sample], name: str, mean: float, var: float) -> None:
    """(x - mean) / sqrt(var + 1e-8) on the tokens with ``loss_mask`` 1; masked tokens keep their value (0)."""
    for s in samples:
        x = torch.tensor(s[name], dtype=torch.float64)
        keep = torch.tensor(s["loss_mask"]) > 0
        s[name] = torch.where(keep, whiten(x, mean, var), x).tolist()


class PPOLag(PPO):
    name = "ppo_lag"
    constrained = True
