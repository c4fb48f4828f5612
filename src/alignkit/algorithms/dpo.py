"""The DPO family (ALGORITHMS 4): sigmoid (DPO; cDPO with label smoothing), ipo, simpo by name.

Per micro-batch of B pairs: ONE forward over all 2B sequences (chosen then rejected) in a single
padding-free packed row; per-sequence log-prob sums over response tokens only (the prompt is
masked) via ``seq_index``; then the pure ``losses.dpo_loss``. Loss unit: one pair.

Reference log-probs (``dpo.reference``):

* ``model``: a frozen copy (``model.ref_name_or_path`` or the policy's start), the ``reference``
  role the runner builds and places;
* ``lora_base``: the policy itself with its LoRA adapters disabled (peft ``disable_adapter()``),
  so no second copy is held in memory;
* ``none``: reference-free (simpo).

A vision-language policy (LLaVA family, ``algorithms.vlm.is_vision_language``) takes image + text rows
(``data.preference``): the same loss; the batches carry ``pixel_values``, the parts ``vlm`` names train.

With ``dpo.precompute_ref_logps`` they are computed ONCE, in ``before_training``, and cached with
the examples (``set_fields``: a side table next to the read-only Arrow rows): every rank computes an interleaved share of the train and eval sets
(``rank, rank + W, ...``), then all ranks exchange their shares (``comm.all_gather_object``), so each
rank holds the values of every example; this keeps working when the sampler reshuffles the shards
every epoch. The reference role is then ``transient``: loaded only for this and freed afterwards.

KL metric ``kl``: the k1 estimate  mean over chosen response tokens of (log pi - log pi_ref). The
token mean of k1 needs only per-sequence sums and lengths:
sum_seq (sum_t log pi - sum_t log pi_ref) / sum_seq |y|, so it is exact with cached sums too.
"""

from __future__ import annotations

import difflib
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch

from alignkit.algorithms.base import Batch, Context, Example, OfflineAlgorithm, policy_specs, resolve_reference
from alignkit.algorithms.vlm import preference_inputs, vlm_spec_options
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.data.examples import set_fields
from alignkit.data.pipelines import PairData
from alignkit.data.preference import count_pairs
from alignkit.distributed import comm
from alignkit.errors import ConfigError
from alignkit.losses.dpo import DPO_LOSSES, dpo_loss
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models, ModelSpec
from alignkit.progress import Progress

if TYPE_CHECKING:
    from alignkit.distributed.strategy.base import Strategy

log = logging.getLogger("alignkit")

#: losses whose value does not use reference log-probs
REFERENCE_FREE = ("simpo",)


@register_section("dpo")
@dataclass
class DPOConfig:
    loss_type: str = f("sigmoid", "Preference loss by name: sigmoid (DPO; cDPO with label_smoothing), ipo, simpo.")
    beta: float = f(0.1, "DPO/cDPO beta (0.01-0.5); IPO tau; SimPO beta (paper: 2-2.5).", gt=0)
    label_smoothing: float = f(0.0, "cDPO: assumed fraction of flipped labels (sigmoid, simpo).", ge=0, le=0.5)
    simpo_gamma: float = f(0.5, "SimPO target reward margin gamma.", ge=0)
    rpo_alpha: float = f(0.0, "RPO: + rpo_alpha * per-token NLL of the chosen response, which keeps its likelihood "
                         "from falling (Pang et al. 2024; TRL rpo_alpha). 0 = plain preference loss.", ge=0)
    reference: Literal["auto", "model", "lora_base", "none"] = f(
        "auto", "Reference log-probs: model = frozen copy of model.ref_name_or_path (or the policy start); "
        "lora_base = the policy with LoRA adapters disabled (no second copy); none = reference-free (simpo); "
        "auto = none for simpo, lora_base with model.lora, else model."
    )
    precompute_ref_logps: bool = f(
        False, "Compute reference log-probs once before training and cache them per example (the reference "
        "model is then freed)."
    )
    pair: Literal["helpful", "safety"] = f("helpful", "Pair of a PKU-SafeRLHF row to train on.")
    logps_chunk_size: int = f(
        0, "Rows of hidden states per LM-head chunk in the log-prob op; 0 = chosen by memory "
        "(512 MiB of float32 logits per chunk on a GPU, 32 MiB on a CPU).", ge=0)

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSSES:
            close = difflib.get_close_matches(self.loss_type, DPO_LOSSES.names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"dpo.loss_type: unknown {self.loss_type!r}{hint}; choose one of {DPO_LOSSES.names()}")
        if self.label_smoothing and self.loss_type == "ipo":
            raise ConfigError("dpo.label_smoothing: applies to sigmoid and simpo, not ipo")


def dpo_reference(cfg: RunConfig) -> str:
    """The concrete reference of ``dpo.reference`` (see the module docstring; simpo needs and loads none)."""
    d = cfg.section(DPOConfig)
    return resolve_reference(cfg, d.reference, needed=d.loss_type not in REFERENCE_FREE,
                             key="dpo.reference", why=f"loss_type {d.loss_type!r} (simpo does not)")


PairValues = Callable[[Batch], dict[tuple[str, str], torch.Tensor]]


def cache_pair_values(collate: Callable[[list[Example]], Batch], sets: tuple[list[Example], ...], strategy: Strategy,
                      values: PairValues, *, batch_size: int, what: str) -> None:
    """Store per-example values computed once (no grad) in every example of ``sets``, on every rank.

    ``values(batch)`` maps ``(key_first, key_second)`` to a ``(2B,)`` tensor (the B chosen sequences,
    then the B rejected ones); example i of the batch gets ``key_first = t[i]``, ``key_second = t[B+i]``.
    Every rank computes an interleaved share (``rank, rank + W, ...``) and all shares are exchanged
    (``comm.all_gather_object``); every rank runs the same number of forwards, as sharded engines need.
    """
    counts = [math.ceil(math.ceil(len(data) / strategy.dp_size) / batch_size) for data in sets]
    bar = Progress(sum(counts), f"precomputing {what}", "batches")
    for data, n_batches in zip(sets, counts):
        mine = list(range(strategy.dp_rank, len(data), strategy.dp_size))
        local: list[tuple[int, str, float]] = []
        for k in range(n_batches):
            bar.update()
            idx = mine[k * batch_size : (k + 1) * batch_size]
            batch = collate([data[i] for i in idx] if idx else [data[0]])
            batch = batch.to(strategy.device)
            with torch.no_grad(), strategy.autocast():
                out = values(batch)
            for (first, second), t in out.items():
                vals = t.double().cpu().tolist()
                local += [(i, first, vals[j]) for j, i in enumerate(idx)]
                local += [(i, second, vals[len(idx) + j]) for j, i in enumerate(idx)]
        for part in comm.all_gather_object(local):
            for i, key, v in part:
                set_fields(data, i, **{key: v})
    bar.close()


class DPO(OfflineAlgorithm):
    name = "dpo"
    sequences_per_example = 2

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        saved, self.processor = preference_inputs(cfg, tokenizer)
        #: the policy's text tokenizer (a vision-language processor's own tokenizer)
        self.text_tokenizer = self.processor.tokenizer if self.processor is not None else tokenizer
        super().__init__(cfg, saved, self.make_data(cfg))
        self.reference = dpo_reference(cfg)
        if cfg.data.streaming and cfg.section(DPOConfig).precompute_ref_logps:
            raise ConfigError("dpo.precompute_ref_logps: needs the whole training set ahead, not data.streaming")

    def make_data(self, cfg: RunConfig) -> PairData:
        """The data pipeline (safe_dpo reads two-response rows instead)."""
        return PairData(self.text_tokenizer, cfg.data, pair=cfg.section(DPOConfig).pair, processor=self.processor)

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        d, vlm = cfg.section(DPOConfig), vlm_spec_options(cfg)
        return policy_specs(cfg, dpo_reference(cfg), kind="vlm" if vlm else "lm", chunk_size=d.logps_chunk_size,
                            transient_reference=d.precompute_ref_logps, **vlm)

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def reference_logps(self, models: Models, batch: Batch) -> torch.Tensor | None:
        """``(2B,)`` reference sums: cached, else from the reference role (a frozen copy or the LoRA base,
        ``Models.running``); None if reference-free."""
        if "ref_logps" in batch:
            return batch["ref_logps"].float()
        if self.reference == "none":
            return None
        return models.sequence_logps("reference", batch)

    def before_training(self, ctx: Context, train_set: list[Example], eval_set: list[Example]) -> None:
        """``dpo.precompute_ref_logps``: cache reference log-probs in every example (module docstring)."""
        if not self.cfg.section(DPOConfig).precompute_ref_logps or self.reference == "none":
            return
        start = time.perf_counter()

        models = ctx.models

        def reference(batch: Batch) -> dict[tuple[str, str], torch.Tensor]:
            logps = self.reference_logps(models, batch)
            assert logps is not None
            return {("ref_chosen_logps", "ref_rejected_logps"): logps}

        cache_pair_values(self.data.collate, (train_set, eval_set), ctx.strategy, reference,
                          batch_size=self.precompute_batch_size(), what="reference log-probs")
        models.free("reference")
        log.info(
            f"Precomputed reference log-probs ({self.reference}) for {len(train_set)} train and {len(eval_set)} eval "
            f"pairs in {time.perf_counter() - start:.1f}s"
        )

    def precompute_batch_size(self) -> int:
        t = self.cfg.training
        return t.eval_batch_size or t.per_device_batch_size or 8

    # ------------------------------------------------------------------ math
    def _pair_losses(self, models: Models, batch: Batch) -> tuple[torch.Tensor, MetricSums]:
        d = self.cfg.section(DPOConfig)
        b = count_pairs(batch)
        ref = self.reference_logps(models, batch)
        logps = models.sequence_logps("policy", batch)
        lengths = batch["response_lengths"].to(logps.dtype)
        losses, met = dpo_loss(
            logps[:b],
            logps[b:],
            None if ref is None else ref[:b],
            None if ref is None else ref[b:],
            loss_type=d.loss_type,
            beta=d.beta,
            label_smoothing=d.label_smoothing,
            simpo_gamma=d.simpo_gamma,
            chosen_lengths=lengths[:b] if d.loss_type in ("simpo", "ipo") else None,
            rejected_lengths=lengths[b:] if d.loss_type in ("simpo", "ipo") else None,
        )
        m = MetricSums()
        if d.rpo_alpha:  # RPO: L + alpha * (-log pi(y_w) / |y_w|), the chosen answer's per-token NLL
            nll = -logps[:b] / lengths[:b].clamp_min(1)
            losses = losses + d.rpo_alpha * nll
            m.add_mean("nll/chosen", nll.detach())
        margin = met["rewards/margin"]
        m.add_mean("rewards/chosen", met["rewards/chosen"])
        m.add_mean("rewards/rejected", met["rewards/rejected"])
        # a tie (e.g. step 0, policy == reference) counts as half right: chance level, not 0
        m.add_mean("rewards/accuracy", (margin > 0).double() + 0.5 * (margin == 0).double())
        m.add_mean("rewards/margin", margin)
        m.add_mean("logps/chosen", logps[:b].detach())
        m.add_mean("logps/rejected", logps[b:].detach())
        if ref is not None:
            m.add("kl", (logps[:b].detach() - ref[:b]).sum(), lengths[:b].sum())
        return losses, m

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        losses, m = self._pair_losses(models, batch)
        return losses.sum() / normalizer, m

    @torch.no_grad()
    def eval_step(self, models: Models, batch: Batch) -> MetricSums:
        losses, m = self._pair_losses(models, batch)
        m.add_mean("loss", losses)
        return m
