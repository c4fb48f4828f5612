"""KTO (Ethayarajh et al. 2024): unpaired desirable / undesirable completions against a frozen reference.

Rows (``data.unpaired``): TRL's ``prompt``/``completion``/``label`` or preference pairs (unpaired into
a desirable chosen and an undesirable rejected). Per micro-batch of B completions: one forward over the
B completions in a padding-free packed row, per-sequence log-prob sums over completion tokens, then
the pure ``losses.kto_loss``. Loss unit: one completion.

The reference point z0 (``losses.kto_reference_point``) is estimated ONCE per optimizer step, before its
micro-batches are accumulated (:meth:`KTO.before_step`): the mean of log pi(y'|x) - log pi_ref(y'|x)
over every mismatched KL pair of the step, all micro-batches of all ranks (one ``comm.all_reduce_sum``
of a sum and a count), without gradient, clamped at 0. Every rank and micro-batch then uses the same
z0, so the loss and the gradient do not depend on the accumulation or the number of ranks; with one
micro-batch per step it is TRL's z0 (a mean over the batch's KL pairs, averaged over ranks). The KL
forwards run without gradient, as TRL's. Evaluation estimates z0 per evaluation batch.

Reference log-probs (``kto.reference``): ``model`` (a frozen copy) or ``lora_base`` (the policy with
its LoRA adapters off), as DPO's; with ``kto.precompute_ref_logps`` they are computed once before training
(completions and KL completions; the KL pairing is fixed per example) and the reference is freed. Metric ``kl``: the step's KL estimate before the clamp.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from alignkit.algorithms.base import Batch, Context, Example, OfflineAlgorithm, policy_specs, resolve_reference
from alignkit.algorithms.dpo import cache_pair_values
from alignkit.algorithms.vlm import is_vision_language
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.data.unpaired import UnpairedData, kl_batch
from alignkit.distributed import comm
from alignkit.errors import ConfigError
from alignkit.losses.kto import kto_loss, kto_reference_point
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models, ModelSpec

if TYPE_CHECKING:
    from alignkit.distributed.strategy.base import Strategy

log = logging.getLogger("alignkit")


@register_section("kto")
@dataclass
class KTOConfig:
    beta: float = f(0.1, "KTO beta: the implicit reward's scale (TRL's default 0.1).", gt=0)
    desirable_weight: float = f(1.0, "Weight of a desirable completion's loss (lambda_D). Keep desirable_weight "
                                "x #desirable / (undesirable_weight x #undesirable) in [1, 4/3] (paper Eq. 8).", ge=0)
    undesirable_weight: float = f(1.0, "Weight of an undesirable completion's loss (lambda_U).", ge=0)
    reference: Literal["auto", "model", "lora_base"] = f(
        "auto", "Reference log-probs: model = frozen copy of model.ref_name_or_path (or the policy start); "
        "lora_base = the policy with LoRA adapters disabled; auto = lora_base with model.lora, else model.")
    precompute_ref_logps: bool = f(
        False, "Compute the reference log-probs of every completion and of its KL completion once before training, "
        "cache them per example and free the reference model (TRL's precompute_ref_log_probs).")
    pair: Literal["helpful", "safety"] = f("helpful", "Pair of a PKU-SafeRLHF row to unpair.")
    logps_chunk_size: int = f(
        0, "Rows of hidden states per LM-head chunk in the log-prob op; 0 = chosen by memory.", ge=0)


def kto_reference(cfg: RunConfig) -> str:
    return resolve_reference(cfg, cfg.section(KTOConfig).reference, needed=True, key="kto.reference")


class KTO(OfflineAlgorithm):
    name = "kto"
    #: one sequence per example trains; its KL sequence runs without gradient (no activations kept)
    sequences_per_example = 1

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer, UnpairedData(tokenizer, cfg.data, pair=cfg.section(KTOConfig).pair))
        self.reference = kto_reference(cfg)
        #: this step's (KL sum, pair count) per micro-batch, in order, and z0 (set by before_step)
        self._step_kl: list[tuple[torch.Tensor, int]] = []
        self._z0: torch.Tensor | None = None

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        if cfg.data.streaming:
            raise ConfigError("data.streaming: kto pairs every completion with another example's prompt for its KL "
                              "estimate, so it needs the whole split; set data.streaming=false")
        if is_vision_language(cfg):
            raise ConfigError("algorithm=kto: text models only (model.name_or_path is a vision-language model)")

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        k = cfg.section(KTOConfig)
        return policy_specs(cfg, kto_reference(cfg), chunk_size=k.logps_chunk_size,
                            transient_reference=k.precompute_ref_logps)

    def before_training(self, ctx: Context, train_set: list[Example], eval_set: list[Example]) -> None:
        """``kto.precompute_ref_logps``: cache the reference log-probs of every completion and KL completion (as
        DPO's, ``cache_pair_values``); warn, as TRL does, when the weights do not balance the desirable and
        undesirable counts (Eq. 8) of the whole training set (``train_set`` may be the first batches alone)."""
        k = self.cfg.section(KTOConfig)
        if k.precompute_ref_logps:
            models = ctx.models

            def reference(batch: Batch) -> dict[tuple[str, str], torch.Tensor]:
                return {("ref_logps", "ref_kl_logps"): torch.cat([self._ref(models, batch), self._ref(models, kl_batch(batch))])}

            t = self.cfg.training
            cache_pair_values(self.data.collate, (train_set, eval_set), ctx.strategy, reference,
                              batch_size=t.eval_batch_size or t.per_device_batch_size or 8, what="reference log-probs")
            models.free("reference")
            log.info(f"Precomputed reference log-probs ({self.reference}) of {len(train_set)} train and {len(eval_set)} "
                     "eval completions and of their KL completions")
        n_d, n_u = self.data.label_counts.get("train", (0, 0))  # the whole data set, counted as it was read
        ratio = k.desirable_weight * max(n_d, 1) / max(k.undesirable_weight * max(n_u, 1), 1e-12)
        if ctx.strategy.is_main and not 1.0 <= round(ratio, 2) <= 1.33:  # rounded as TRL's check is
            log.warning(f"kto: data.train holds {n_d} desirable and {n_u} undesirable completions; desirable_weight x {n_d} / "
                        f"(undesirable_weight x {n_u}) = {ratio:.2f}, outside [1, 4/3] (KTO paper Eq. 8): e.g. set "
                        f"kto.desirable_weight={k.undesirable_weight * max(n_u, 1) / max(n_d, 1):.2f}")

    # ------------------------------------------------------------------ z0, once per step
    @torch.no_grad()
    def _ref(self, models: Models, batch: Batch) -> torch.Tensor:
        """``(B,)`` reference log-prob sums: cached (``kto.precompute_ref_logps``), else from the reference role."""
        if "ref_logps" in batch:
            return batch["ref_logps"].float()
        return models.sequence_logps("reference", batch)

    @torch.no_grad()
    def _kl_sums(self, models: Models, batch: Batch) -> torch.Tensor:
        """Sum over the batch's KL pairs of log pi(y'|x) - log pi_ref(y'|x), float64 (no gradient)."""
        kl = kl_batch(batch)
        return (models.sequence_logps("policy", kl).double() - self._ref(models, kl).double()).sum()

    def before_step(self, ctx: Context, group: list[Batch]) -> None:
        """z0 of the optimizer step from every micro-batch's KL pairs, summed over ranks (module docstring)."""
        strategy: Strategy = ctx.strategy
        self._step_kl = []
        for batch in group:
            with strategy.autocast():
                self._step_kl.append((self._kl_sums(ctx.models, batch.to(strategy.device)),
                                      int(batch["desirable"].shape[0])))
        local = torch.stack([torch.stack([s for s, _ in self._step_kl]).sum(),
                             torch.tensor(float(sum(n for _, n in self._step_kl)), dtype=torch.float64,
                                          device=strategy.device)])
        total = comm.all_reduce_sum(local)
        self._z0 = kto_reference_point(total[0], total[1])

    # ------------------------------------------------------------------ math
    def _losses(self, models: Models, batch: Batch, z0: torch.Tensor) -> tuple[torch.Tensor, MetricSums]:
        k = self.cfg.section(KTOConfig)
        logps = models.sequence_logps("policy", batch)
        ref = self._ref(models, batch)
        desirable = batch["desirable"]
        losses, met = kto_loss(logps, ref, desirable, z0.to(logps.dtype), beta=k.beta,
                               desirable_weight=k.desirable_weight, undesirable_weight=k.undesirable_weight)
        m = MetricSums()
        m.add_masked_mean("rewards/chosen", met["rewards"], desirable)
        m.add_masked_mean("rewards/rejected", met["rewards"], ~desirable)
        m.add_masked_mean("logps/chosen", logps, desirable)
        m.add_masked_mean("logps/rejected", logps, ~desirable)
        return losses, m

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        if not self._step_kl or self._z0 is None:
            raise RuntimeError("KTO.loss: call before_step with the optimizer step's micro-batches first (z0)")
        kl_sum, count = self._step_kl.pop(0)
        losses, m = self._losses(models, batch, self._z0)
        m.add("kl", kl_sum, count)
        return losses.sum() / normalizer, m

    @torch.no_grad()
    def eval_step(self, models: Models, batch: Batch) -> MetricSums:
        kl_sum, count = self._kl_sums(models, batch), int(batch["desirable"].shape[0])
        losses, m = self._losses(models, batch, kto_reference_point(kl_sum, torch.tensor(float(count))))
        m.add("kl", kl_sum, count)
        m.add_mean("loss", losses)
        return m
