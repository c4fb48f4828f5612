"""Policy-gradient and value losses of the online algorithms (ALGORITHMS 3 and 4), as pure functions.

Every function works on the FLAT token layout the log-prob forward returns: ``(N,)`` tensors over
the completion tokens of a micro-batch in row-major order, with ``seq`` ``(N,)`` the sequence each
token belongs to. Per-token losses come back unreduced; :func:`aggregate` turns them into the
micro-batch's share of the step loss with a normaliser the loop computed over ALL micro-batches and
ranks of the step (never discovered here).

* clipped surrogate (PPO / GRPO):  -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho =
  exp(logp - logp_old) per token, or per sequence (GSPO: rho_i = exp(mean_t (logp - logp_old)),
  shared by the sequence's tokens); ``eps_high > eps_low`` is DAPO's clip-higher.
* sampler correction (vLLM rollouts): w = exp(logp_old - logp_sampler) per token (or the product over a
  sequence), truncated at ``cap`` (TIS, Yao et al. 2025; TRL's ``vllm_importance_sampling_correction``) or
  zeroed above it (masked IS); multiplies the per-token loss, correcting for the sampler's numerics or for a
  behaviour policy some versions behind (asynchronous RL). ``icepop``: the token ratio kept where it lies in
  ``[low, cap]`` and 0 outside (IcePop, Ring-1T 2025); ``sequence_geo_mask``: weight 1, or 0 for a whole
  sequence whose geometric-mean ratio exp(mean_t log ratio) lies outside ``[low, cap]`` (verl / SkyRL's
  geometric sequence mask: rejection, no reweighting).
* decoupled objective (Hilton et al. 2022; AReaL): clip against the proximal policy (``old_logps``, recomputed
  by the trainer), times the behaviour weight pi_prox / pi_behav above: :func:`decoupled_surrogate`.
* CISPO (MiniMax-M1 2025): -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A logp: the clipped importance weight,
  stop-gradient, on a REINFORCE term, so a clipped token still has a gradient.
* clipped value loss (PPO): 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-eps_v) - R)^2).
* aggregation: ``token_mean`` = sum over tokens / global tokens; ``sequence_mean`` = sum over
  sequences of the sequence's token mean / global sequences (GRPO's 1/|o_i|); ``constant`` = sum over
  tokens / (global sequences x max_new_tokens) (Dr. GRPO: no length bias).
"""

from __future__ import annotations

import torch
from torch import Tensor

from alignkit.ops.segments import segment_sum

AGGREGATIONS = ("token_mean", "sequence_mean", "constant")


def clipped_surrogate(logps: Tensor, old_logps: Tensor, advantages: Tensor, *, eps_low: float, eps_high: float,
                      seq: Tensor | None = None, num_seqs: int = 0, level: str = "token",
                      mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-token clipped policy loss ``(N,)`` and a per-token "was clipped" flag ``(N,)`` (float).

    logps, old_logps, advantages: ``(N,)``. ``level="sequence"`` needs ``seq`` and ``num_seqs``; its mean log-ratio
    is over the tokens ``mask`` ``(N,)`` keeps (an agent's policy tokens: not the environment's), all without one."""
    log_ratio = logps - old_logps
    if level == "sequence":
        if seq is None:
            raise ValueError("sequence-level ratios need the token -> sequence map")
        seq_mean = masked_segment_mean(log_ratio, seq, num_seqs, mask)  # (S,)
        # the sequence ratio, with each token's gradient flowing through its own term (GSPO-token form)
        log_ratio = seq_mean[seq].detach() + log_ratio - log_ratio.detach()
    elif level != "token":
        raise ValueError(f"importance ratio level must be 'token' or 'sequence', got {level!r}")
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).float().detach()
    return loss, was_clipped


SAMPLER_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop",
                       "sequence_geo_mask")


def sampler_is_weights(old_logps: Tensor, sampler_logps: Tensor, *, cap: float, mode: str = "token_truncate",
                       seq: Tensor | None = None, num_seqs: int = 0, low: float = 0.0,
                       mask: Tensor | None = None) -> Tensor:
    """``(N,)`` importance weights (no gradient) of tokens sampled by another engine or an older policy:
    ``pi_old / pi_sampler`` with ``old_logps`` the trainer's log-probs of the sampled tokens and ``sampler_logps``
    the sampler's (vLLM's, or the behaviour policy's), both ``(N,)``. ``mode`` = granularity x constraint:
    ``token_*`` one ratio per token, ``sequence_*`` exp of the sequence's summed log-ratio shared by its tokens
    (needs ``seq``, ``num_seqs``); ``*_truncate`` min(ratio, cap), ``*_mask`` 0 where the ratio exceeds ``cap``;
    ``icepop`` the token ratio where ``low <= ratio <= cap``, else 0; ``sequence_geo_mask`` 1, or 0 on every token
    of a sequence whose exp(mean_t log ratio) lies outside ``[low, cap]``. ``mask`` ``(N,)``: the tokens a sequence
    mode sums or averages over (an agent's policy tokens; the environment's ids are no draw of either policy); all
    without one. A sequence with no kept token gets ratio 1."""
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"sampler correction mode must be one of {SAMPLER_CORRECTIONS}, got {mode!r}")
    log_ratio = (old_logps - sampler_logps).detach().float()
    if mode.startswith("sequence"):
        if seq is None:
            raise ValueError("sequence-level weights need the token -> sequence map")
        if mode == "sequence_geo_mask":  # the per-token geometric mean of the sequence's ratio
            summed = masked_segment_mean(log_ratio, seq, num_seqs, mask)
        else:
            summed = segment_sum(log_ratio if mask is None else log_ratio * mask, seq, num_seqs)
        log_ratio = summed[seq]
    ratio = torch.exp(log_ratio.clamp(max=20.0))  # exp(20) is far past any cap: no overflow
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    outside = (ratio > cap) | (ratio < low) if mode in ("icepop", "sequence_geo_mask") else ratio > cap
    kept = torch.ones_like(ratio) if mode == "sequence_geo_mask" else ratio
    return kept.masked_fill(outside, 0.0)


def masked_segment_mean(x: Tensor, seq: Tensor, num_seqs: int, mask: Tensor | None) -> Tensor:
    """``(S,)`` each sequence's mean of ``x`` ``(N,)`` over its tokens ``mask`` keeps (all without one; 0 if none)."""
    kept = torch.ones_like(x) if mask is None else mask.to(x.dtype)
    return segment_sum(x * kept, seq, num_seqs) / segment_sum(kept, seq, num_seqs).clamp_min(1)


def decoupled_surrogate(logps: Tensor, prox_logps: Tensor, behav_logps: Tensor, advantages: Tensor, *,
                        eps_low: float, eps_high: float, correction: str, cap: float, low: float = 0.0,
                        seq: Tensor | None = None, num_seqs: int = 0, level: str = "token",
                        mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The decoupled PPO objective (Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL):
    ``w * clipped_surrogate(logps, prox_logps)`` with the clip against the proximal policy ``prox_logps`` (the
    trainer's recomputed old log-probs) and ``w`` = :func:`sampler_is_weights` (pi_prox / pi_behav by
    ``correction``, ``cap``, ``low``) to the behaviour policy that sampled (``behav_logps``); all ``(N,)``.
    ``mask``: the policy's tokens of the sequence-level sums. Returns the per-token loss, the clipped flag and ``w``."""
    loss, clipped = clipped_surrogate(logps, prox_logps, advantages, eps_low=eps_low, eps_high=eps_high, seq=seq,
                                      num_seqs=num_seqs, level=level, mask=mask)
    w = sampler_is_weights(prox_logps, behav_logps, cap=cap, mode=correction, seq=seq, num_seqs=num_seqs, low=low,
                           mask=mask)
    return loss * w, clipped, w


def cispo_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, *, eps_low: float,
               eps_high: float) -> tuple[Tensor, Tensor]:
    """CISPO's per-token loss ``(N,)`` (MiniMax-M1, eq. 4): ``-sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * logp``
    with rho = exp(logp - logp_old), and the per-token "weight was clipped" flag ``(N,)`` (float). The gradient is
    ``-clip(rho) A grad logp`` on every token, clipped or not (PPO's clip zeroes it)."""
    ratio = torch.exp(logps - old_logps).detach()
    w = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -w * advantages * logps, (w != ratio).float()


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, *, clip: float) -> Tensor:
    """Per-token ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)``; clip <= 0 = unclipped."""
    plain = (values - returns).square()
    if clip <= 0:
        return 0.5 * plain
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum(plain, (v_clipped - returns).square())


def aggregate(per_token: Tensor, seq: Tensor, num_seqs: int, *, mode: str, normalizer: float) -> Tensor:
    """This micro-batch's share of the step loss: a sum over its tokens (``token_mean``,
    ``constant``) or over its sequences' token means (``sequence_mean``), divided by ``normalizer``
    (the step's global tokens, sequences, or sequences x max_new_tokens, over dp_size)."""
    if mode in ("token_mean", "constant"):
        return per_token.sum() / normalizer
    if mode == "sequence_mean":
        lengths = segment_sum(torch.ones_like(per_token), seq, num_seqs).clamp_min(1)
        return (segment_sum(per_token, seq, num_seqs) / lengths).sum() / normalizer
    raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")
