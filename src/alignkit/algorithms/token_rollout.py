"""What the online algorithms of a token policy share, as a part each builds (``self.tokens``) rather than methods
of the ``OnlineAlgorithm`` base: the temperature every log-prob is taken at, the masking of cut completions, the
rollout engine's sampler log-probs and their importance weights in the loss, and per-sample log-prob forwards
(GRPO / RLOO / Dr. GRPO, PPO, red-team RL, plugins such as ``tests/plugins/judged_grpo.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from alignkit.config.schema import RunConfig
from alignkit.data.batch import Batch
from alignkit.losses.rl import sampler_is_weights
from alignkit.metrics import MetricSums
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import RolloutContext
from alignkit.rollout.correction import OffPolicyConfig
from alignkit.rollout.engine import Generations, ImportanceSampling, RolloutEngine, engine_class, engine_settings
from alignkit.rollout.experience import Sample, flat, per_sequence, token_seq


def run_engine(cfg: RunConfig) -> tuple[type[RolloutEngine], Any]:
    """The class of the run's ``rollout.engine`` and its settings (its own section of ``cfg``; None without one)."""
    engine = engine_class(cfg.section(RolloutConfig).engine)
    return engine, engine_settings(engine, cfg)


class TokenRollout:
    """A token policy's rollout and update pieces, read off the run's config ``cfg``."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    @property
    def updates_per_iteration(self) -> int:
        """Optimizer steps per iteration: ``rollout.update_epochs`` x ``rollout.mini_batches``; above 1 the old
        log-probs must be stored (a later step's policy is not the one that sampled)."""
        return self.cfg.section(RolloutConfig).steps_per_iteration

    def importance_sampling(self) -> ImportanceSampling | None:
        """How the loss weights the tokens a sample's behaviour policy drew: the run's engine's correction for its
        own sampler (``vllm.importance_sampling_*``), else the ``off_policy:`` section's (a generator some policy
        versions behind: rollout/correction.py); None: weight 1."""
        engine, settings = run_engine(self.cfg)
        own = engine.importance_sampling(settings)
        if own is not None:
            return own
        o = self.cfg.section(OffPolicyConfig)
        return None if o.correction == "none" else ImportanceSampling(o.correction, o.cap, o.low)

    @property
    def temperature(self) -> float:
        """The temperature of every log-prob the update uses (old, new, reference, and the logged entropy):
        the sampler's ``rollout.temperature``, so ratios and KL are of the distribution the completions were
        drawn from (TRL's grpo_trainer ``_get_per_token_logps_and_entropies``: ``logits.div_(self.temperature)``;
        its PPO trainer ``logits /= args.temperature + 1e-7``). Top-k / top-p are NOT applied to these
        log-probs: TRL samples with them but scores the full tempered softmax (no truncation in
        ``_get_per_token_logps_and_entropies``), and so do we. Greedy rollouts (temperature 0) score at 1.0."""
        t = self.cfg.section(RolloutConfig).temperature
        return t if t > 0 else 1.0

    def mask_truncated(self, samples: list[Sample], truncated: list[bool]) -> None:
        """``rollout.mask_truncated_completions``: the tokens of a completion cut by max_new_tokens get
        ``loss_mask`` 0 (no gradient, not counted by a token-mean normaliser), the others 1."""
        if self.cfg.section(RolloutConfig).mask_truncated_completions:
            for s, cut in zip(samples, truncated):
                s["loss_mask"] = [0.0 if cut else 1.0] * len(s["completion_ids"])

    def keep_sampler_logps(self, samples: list[Sample], gens: Generations) -> None:
        """Each sample keeps the sampler's log-probs of its tokens (``sampler_logps``) when the engine reports
        them and the loss corrects for them (:meth:`importance_sampling`), for the loss's importance weights."""
        if gens.logps is not None and self.importance_sampling() is not None:
            for s, logps in zip(samples, gens.logps):
                s["sampler_logps"] = logps

    def sampler_weights(self, batch: Batch, old_logps: torch.Tensor, keep: torch.Tensor, m: MetricSums) -> torch.Tensor:
        """``(N,)`` the importance weights of the tokens a behaviour policy sampled (``sampler_logps`` in the batch:
        pi_old / pi_behav, truncated or masked per :meth:`importance_sampling`: with ``old_logps`` the trainer's
        proximal policy this makes the update the decoupled objective, losses/rl.py ``decoupled_surrogate``), logged
        over the ``keep`` tokens (also the tokens a sequence mode's log-ratio sums): the ratio before the cap, the weight, the share the cap changed
        (``sampler_is_capped``) and the share zeroed (``sampler_is_masked``); all ones without ``sampler_logps``."""
        v = self.importance_sampling() if "sampler_logps" in batch else None  # no config read for a plain batch
        if v is None:
            return torch.ones_like(old_logps)
        behav, seq, S = flat(batch, "sampler_logps"), token_seq(batch), int(batch["response_lengths"].shape[0])
        level = "sequence_truncate" if v.mode.startswith("sequence") else "token_truncate"  # the plain ratio's level
        # a sequence mode's sums run over the kept tokens: an agent's policy ids, never the environment's
        ratio = sampler_is_weights(old_logps, behav, cap=float("inf"), mode=level, seq=seq, num_seqs=S, mask=keep)
        w = sampler_is_weights(old_logps, behav, cap=v.cap, mode=v.mode, seq=seq, num_seqs=S, low=v.low, mask=keep)
        m.add_masked_mean("sampler_is_ratio", ratio, keep)  # before the cap: how far the two samplers differ
        m.add_masked_mean("sampler_is_weight", w, keep)
        changed = (w == 0) if v.mode == "sequence_geo_mask" else (w != ratio)  # geo: weights are 0 / 1, not r
        m.add_masked_mean("sampler_is_capped", changed.double(), keep)
        m.add_masked_mean("sampler_is_masked", (w == 0).double(), keep)
        return w

    @torch.no_grad()
    def logps(self, ctx: RolloutContext, batches: list[Batch], *, role: str = "policy") -> list[list[float]]:
        """Per-sample completion-token log-probs of ``role`` (``reference`` served by the LoRA base when
        it shares the policy: ``Models.running``) at the :attr:`temperature`, in the training
        forward's numerics."""
        out: list[list[float]] = []
        for batch in batches:
            with ctx.strategy.autocast():
                out += per_sequence(ctx.models.logps(role, batch, temperature=self.temperature), batch)
        return out
