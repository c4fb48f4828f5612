"""The DPO family (ALGORITHMS 4): sigmoid (DPO; cDPO with label smoothing), ipo, simpo by name.

Per micro-batch of B pairs: ONE forward over all 2B sequences (chosen then rejected) in a single
padding-free packed row; per-sequence log-prob sums over response tokens only (the prompt is
masked) via ``seq_index``; then the pure ``losses.dpo_loss``. Loss unit: one pair.

Reference log-probs (``dpo.reference``):

* ``model``: a frozen copy (``model.ref_name_or_path`` or the policy's start), placed by
  ``strategy.prepare_frozen``;
* ``lora_base``: the policy itself with its LoRA adapters disabled (peft ``disable_adapter()``),
  so no second copy is held in memory;
* ``none``: reference-free (simpo).

With ``dpo.precompute_ref_logps`` they are computed ONCE, in ``before_training``, and cached in
the examples: every rank computes an interleaved share of the train and eval sets
(``rank, rank + W, ...``), then all ranks exchange their shares (``comm.all_gather_object``), so each
rank holds the values of every example; this keeps working when the sampler reshuffles the shards
every epoch. A frozen reference model is loaded only for this and freed afterwards.

KL metric ``kl``: the k1 estimate  mean over chosen response tokens of (log pi - log pi_ref). The
token mean of k1 needs only per-sequence sums and lengths:
sum_seq (sum_t log pi - sum_t log pi_ref) / sum_seq |y|, so it is exact with cached sums too.
"""

from __future__ import annotations

import difflib
import logging
import math
import time
from typing import Any

import torch
from torch import nn

from alignkit.algorithms.base import MetricSums, OfflineAlgorithm, PairBatches
from alignkit.constants import IGNORE_INDEX
from alignkit.data.preference import count_pairs
from alignkit.distributed import comm
from alignkit.errors import ConfigError
from alignkit.losses.dpo import DPO_LOSSES, dpo_loss
from alignkit.models.adapters import adapters_disabled, is_adapter_dir, load_lm
from alignkit.models.policy import CausalLMLogps
from alignkit.ops.segments import segment_sum

log = logging.getLogger("alignkit")

#: losses whose value does not use reference log-probs
REFERENCE_FREE = ("simpo",)


def resolve_reference(cfg: Any) -> str:
    """The concrete reference source for ``dpo.reference`` (see the module docstring)."""
    d, m = cfg.dpo, cfg.model
    has_lora = m.lora is not None or is_adapter_dir(m.name_or_path)
    if d.reference == "auto":
        if d.loss_type in REFERENCE_FREE:
            return "none"
        return "lora_base" if has_lora and not m.ref_name_or_path else "model"
    if d.reference == "none" and d.loss_type not in REFERENCE_FREE:
        raise ConfigError(f"dpo.reference=none: loss_type {d.loss_type!r} needs reference log-probs (simpo does not)")
    if d.reference == "lora_base" and not has_lora:
        raise ConfigError("dpo.reference=lora_base needs LoRA adapters (set model.lora)")
    return d.reference


class DPO(PairBatches, OfflineAlgorithm):
    name = "dpo"
    loss_unit = "sequences"

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        d = cfg.dpo
        if d.loss_type not in DPO_LOSSES:
            close = difflib.get_close_matches(d.loss_type, DPO_LOSSES.names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"dpo.loss_type: unknown {d.loss_type!r}{hint}; choose one of {DPO_LOSSES.names()}")
        if d.label_smoothing and d.loss_type == "ipo":
            raise ConfigError("dpo.label_smoothing: applies to sigmoid and simpo, not ipo")
        self.reference = resolve_reference(cfg)
        self.ref_model: nn.Module | None = None
        self.pair = cfg.dpo.pair

    # ------------------------------------------------------------------ models
    def build_policy(self, dtype: torch.dtype) -> nn.Module:
        return CausalLMLogps(load_lm(self.cfg.model, dtype=dtype), chunk_size=self.cfg.dpo.logps_chunk_size)

    def _load_reference(self, strategy: Any) -> nn.Module:
        m = self.cfg.model
        lm = load_lm(m, name_or_path=m.ref_name_or_path or m.name_or_path, dtype=strategy.compute_dtype, trainable=False)
        return strategy.prepare_frozen(CausalLMLogps(lm, chunk_size=self.cfg.dpo.logps_chunk_size))

    def build_frozen(self, strategy: Any) -> dict[str, nn.Module]:
        if self.reference != "model" or self.cfg.dpo.precompute_ref_logps:
            return {}
        self.ref_model = self._load_reference(strategy)
        return {"reference": self.ref_model}

    # ------------------------------------------------------------------ log-probs
    @staticmethod
    def sequence_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(2B,)`` sums of response-token log-probs, one per sequence (chosen, then rejected)."""
        token_logps = model(
            input_ids=batch["input_ids"],
            targets=batch["targets"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
        )  # (N,) in row-major order of the non-ignored targets
        seq = batch["seq_index"][batch["targets"] != IGNORE_INDEX]
        return segment_sum(token_logps, seq, int(batch["response_lengths"].shape[0]))

    @torch.no_grad()
    def reference_logps(self, model: nn.Module, batch: dict[str, torch.Tensor], ref_model: nn.Module | None = None) -> torch.Tensor | None:
        """``(2B,)`` reference sums: cached, from the frozen model, or from the LoRA base; None if reference-free."""
        if "ref_logps" in batch:
            return batch["ref_logps"].float()
        if self.reference == "none":
            return None
        if self.reference == "model":
            ref = ref_model or self.ref_model
            if ref is None:
                raise RuntimeError("DPO: the reference model is not loaded (build_frozen / before_training not called)")
            return self.sequence_logps(ref, batch)
        was_training = model.training
        model.eval()  # the reference runs without dropout, like a frozen copy would
        try:
            with adapters_disabled(model):
                return self.sequence_logps(model, batch)
        finally:
            model.train(was_training)

    def before_training(self, model: nn.Module, train_set: list[dict[str, Any]], eval_set: list[dict[str, Any]], strategy: Any) -> None:
        """``dpo.precompute_ref_logps``: cache reference log-probs in every example (module docstring)."""
        if not self.cfg.dpo.precompute_ref_logps or self.reference == "none":
            return
        start = time.perf_counter()
        ref = self._load_reference(strategy) if self.reference == "model" else None
        t = self.cfg.training
        bs = t.eval_batch_size or t.per_device_batch_size or 8
        for data in (train_set, eval_set):
            mine = list(range(strategy.dp_rank, len(data), strategy.dp_size))
            # every rank runs the same number of forwards (sharded engines gather inside forward)
            n_batches = math.ceil(math.ceil(len(data) / strategy.dp_size) / bs)
            local: list[tuple[int, float, float]] = []
            for k in range(n_batches):
                idx = mine[k * bs : (k + 1) * bs]
                batch = self.collate([data[i] for i in idx] if idx else data[:1])
                batch = {key: v.to(strategy.device) for key, v in batch.items()}
                with strategy.autocast():
                    logps = self.reference_logps(model, batch, ref)
                assert logps is not None
                values = logps.double().cpu().tolist()
                local += [(i, values[j], values[len(idx) + j]) for j, i in enumerate(idx)]
            for part in comm.all_gather_object(local):
                for i, c, r in part:
                    data[i]["ref_chosen_logps"], data[i]["ref_rejected_logps"] = c, r
        del ref
        log.info(
            f"Precomputed reference log-probs ({self.reference}) for {len(train_set)} train and {len(eval_set)} eval "
            f"pairs in {time.perf_counter() - start:.1f}s"
        )

    # ------------------------------------------------------------------ math
    def _pair_losses(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, MetricSums]:
        d = self.cfg.dpo
        b = count_pairs(batch)
        ref = self.reference_logps(model, batch)
        logps = self.sequence_logps(model, batch)
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

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        losses, m = self._pair_losses(model, batch)
        return losses.sum() / normalizer, m

    @torch.no_grad()
    def eval_step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> MetricSums:
        losses, m = self._pair_losses(model, batch)
        m.add_mean("loss", losses)
        return m
