"""On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): the student (``policy``) samples
completions of the prompts, and each sampled position's full next-token distribution is pulled toward a frozen
``teacher``'s at the same position by GKD's generalised JSD (losses/distill.py): ``distill.beta: 1`` (default)
the reverse KL(student || teacher) per token, ``0`` the forward KL, in between the JSD mixture (TRL GKDTrainer's
convention). The divergence is the FULL sum over the vocabulary (exact, no sampling noise): by default the
forwards build ``(tokens, vocab)`` log-probs (sized for vocabularies that fit); ``distill.chunk_tokens: N`` takes
the chunked path instead (``chunked_generalized_jsd``: both models' final hidden states at the completion
positions, N at a time through the LM heads, nothing of the vocabulary's size kept for the backward; the same
values). The per-token sampled estimator log p_s - log p_t is not offered. The loss is a token mean over the step's
completion tokens (the global normaliser); rewards of ``reward.functions`` are scored and logged (the task's
score) but train nothing. Teacher and student must share a tokenizer: token ids are compared position by
position, so another vocabulary is refused in one line before the first rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignkit.algorithms.base import Batch, Context, Example, policy_specs
from alignkit.algorithms.online import OnlineAlgorithm
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.errors import ConfigError, ModelError
from alignkit.losses.distill import chunked_generalized_jsd, generalized_jsd
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models, ModelSpec, same_vocabulary
from alignkit.ops.logprobs import chunked_token_logps
from alignkit.rewards.signals import nan_stats
from alignkit.rollout.context import RolloutContext
from alignkit.rollout.experience import Sample, flat


@register_section("distill")
@dataclass
class DistillConfig:
    teacher: str = f("", "The frozen teacher: a model folder or hub id with the student's tokenizer (required).")
    beta: float = f(1.0, "GKD's generalised JSD interpolation (TRL GKDTrainer's convention): 1 = reverse "
                    "KL(student || teacher), on-policy distillation's loss; 0 = forward KL(teacher || student); "
                    "in between the JSD to the mixture beta teacher + (1 - beta) student.", ge=0, le=1)
    chunk_tokens: int = f(0, "0 = the divergence from (tokens, vocab) log-probs of both models (exact, for vocabularies "
                          "that fit); N > 0 = the chunked path (losses/distill.py chunked_generalized_jsd): each model's "
                          "final hidden states, N positions at a time through the LM heads, nothing of the vocabulary's "
                          "size kept for the backward (the same values; for large vocabularies).", ge=0)


class OnPolicyDistill(OnlineAlgorithm):
    """``algorithm: distill``: the student's own samples, the full-distribution divergence to the teacher."""

    name = "distill"

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        if not cfg.section(DistillConfig).teacher:
            raise ConfigError("distill.teacher is required: the frozen teacher model (a folder or hub id)")

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        teacher = cfg.section(DistillConfig).teacher
        return [*policy_specs(cfg, "none"), ModelSpec("teacher", teacher, "lm", tokenizer=teacher)]

    def before_training(self, ctx: Context, train_set: list[Example], eval_set: list[Example]) -> None:
        if not same_vocabulary(ctx.models.tokenizer("teacher"), ctx.models.tokenizer("policy")):
            raise ModelError(f"distill.teacher {self.cfg.section(DistillConfig).teacher} has another tokenizer than "
                             "the student: on-policy distillation compares token ids position by position, so both "
                             "must share one vocabulary")
        super().before_training(ctx, train_set, eval_set)

    def make_experience(self, ctx: RolloutContext, samples: list[Sample], batches: list[Batch],
                        scores: dict[str, torch.Tensor]) -> MetricSums:
        """Nothing for the loss beyond the samples (the teacher runs in the loss); the reward's spread logged."""
        m = MetricSums()
        m.add("reward_std", nan_stats(scores["reward"])[1], 1)
        return m

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor, MetricSums]:
        section = self.cfg.section(DistillConfig)
        per_token, teacher_logp = (self.chunked(models, batch, section) if section.chunk_tokens
                                   else self.full(models, batch, section.beta))
        keep = flat(batch, "loss_mask") if "loss_mask" in batch else torch.ones_like(per_token)
        m = MetricSums()
        m.add_masked_mean("distill_divergence", per_token.detach(), keep)
        m.add_masked_mean("teacher_logp", teacher_logp, keep)
        return (per_token * keep).sum() / normalizer, m

    def full(self, models: Models, batch: Batch, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(N,)`` divergences and teacher log-probs of the sampled tokens from both models' ``(N, V)`` log-probs."""
        t = self.tokens.temperature
        student = models.logps("policy", batch, temperature=t, full_vocab=True)  # (N, V)
        with torch.no_grad():
            teacher = models.logps("teacher", batch, temperature=t, full_vocab=True)
        check_vocab(teacher.shape[-1], student.shape[-1])
        return generalized_jsd(student, teacher, beta=beta), teacher.gather(-1, flat_targets(batch)).squeeze(-1)

    def chunked(self, models: Models, batch: Batch, section: DistillConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The same as :meth:`full` through :func:`chunked_generalized_jsd`: the teacher's ``(N, H)`` hidden states
        and head weight, the student's divergence computed inside its own forward, ``chunk_tokens`` at a time."""
        t = self.tokens.temperature
        with torch.no_grad():
            hidden, head = models.logps("teacher", batch, on_hidden=lambda h, w: (h.detach(), w.detach()))
        if type(head) is not torch.Tensor or head.numel() == 0:  # a DTensor (FSDP) or a ZeRO-3 placeholder
            raise ModelError("distill.chunk_tokens reads the teacher's LM head outside its forward, which a sharded "
                             "teacher does not allow: set distributed.shard_frozen: false (or distill.chunk_tokens: 0)")
        targets = flat_targets(batch)

        def teacher_logits(start: int, end: int) -> torch.Tensor:
            return hidden[start:end] @ head.T

        def divergence(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            check_vocab(head.shape[0], w.shape[0])
            return chunked_generalized_jsd(h, w, teacher_logits, beta=section.beta, temperature=t,
                                           chunk_tokens=section.chunk_tokens)

        per_token = models.logps("policy", batch, on_hidden=divergence)
        with torch.no_grad():
            teacher_logp = chunked_token_logps(hidden, head, targets.squeeze(-1), temperature=t,
                                               chunk_size=section.chunk_tokens)
        return per_token, teacher_logp

    def units(self, batch: Batch) -> int:
        """Completion tokens (those ``loss_mask`` keeps): the loss is a token mean over the step."""
        return int(batch["loss_mask"].sum()) if "loss_mask" in batch else int(batch["response_lengths"].sum())


def check_vocab(teacher: int, student: int) -> None:
    """Refuse, in one line, a teacher whose LM head scores another number of tokens than the student's."""
    if teacher != student:
        raise ModelError(f"distill.teacher scores {teacher} tokens, the student {student}: the two models must share "
                         "one vocabulary")


def flat_targets(batch: Batch) -> torch.Tensor:
    """``(N, 1)`` the sampled token at each completion position (row-major, as the log-prob forward)."""
    return flat(batch, "targets").long().unsqueeze(-1)
