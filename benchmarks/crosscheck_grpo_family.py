#!/usr/bin/env python
"""alignkit's GRPO-family losses against TRL 1.16's own code on the same fixed tensors (values and gradients).

    python -m venv /tmp/trl6 --system-site-packages && /tmp/trl6/bin/pip install trl==1.16.0
    PYTHONPATH=src /tmp/trl6/bin/python benchmarks/crosscheck_grpo_family.py [--out results/crosscheck_grpo_family.json]

Runs in TRL's virtualenv (TRL is never a dependency of alignkit; the venv sees the system's torch and, through
PYTHONPATH, alignkit's source). TRL side: ``GRPOTrainer._compute_loss`` called on a stand-in trainer (the
attributes it reads, a log-prob forward that returns the fixed per-token log-probs) and
``GKDTrainer.generalized_jsd_loss``. alignkit side: ``losses.rl`` (``clipped_surrogate``, ``cispo_loss``,
``aggregate``) and ``losses.distill.generalized_jsd``. Cases:

* ``dapo_clip_higher``: TRL ``loss_type="dapo"``, epsilon 0.2, epsilon_high 0.28 / alignkit token ratios, clip
  [0.8, 1.28], ``token_mean``;
* ``gspo``: TRL ``importance_sampling_level="sequence"``, ``loss_type="grpo"`` / alignkit ``level="sequence"``,
  ``sequence_mean``;
* ``cispo``: TRL ``loss_type="cispo"``, epsilon_high 5.0 (the bound itself) / alignkit ``cispo_loss`` with
  eps_high 4.0 (bound 1 + 4.0), no lower bound, ``token_mean``;
* ``gkd_beta{0,0.5,1}``: TRL's generalised JSD (batchmean over unmasked tokens) / alignkit's token mean.

Prints and writes the max absolute difference of the loss and of its gradient with respect to the per-token
log-probs (GKD: the student logits).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

from alignkit.losses.distill import generalized_jsd
from alignkit.losses.rl import aggregate, cispo_loss, clipped_surrogate

B, T, V = 6, 7, 11


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for i in range(B):
        mask[i, : int(torch.randint(2, T + 1, (1,), generator=g))] = 1
    logps = -torch.rand(B, T, generator=g) * 3
    old = logps + 0.4 * torch.randn(B, T, generator=g)  # ratios from ~0.3 to ~3: both clips act
    adv = torch.randn(B, generator=g)
    return {"logps": logps, "old": old, "mask": mask, "adv": adv}


def trl_grpo_loss(x: dict[str, torch.Tensor], loss_type: str, level: str, eps: float,
                  eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    from trl import GRPOTrainer

    logps = x["logps"].clone().requires_grad_()
    accel = SimpleNamespace(gather=lambda t: t, reduce=lambda t, reduction="sum": t, num_processes=1)
    stub = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=0.0,
        loss_type=loss_type, epsilon_low=eps, epsilon_high=eps_high, use_vllm=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, use_adaptive_entropy=False, entropy_coef=0.0, accelerator=accel,
        current_gradient_accumulation_steps=1, _metrics=defaultdict(lambda: defaultdict(list)),
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None))
    batch = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
             "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": x["mask"].long(),
             "advantages": x["adv"], "old_per_token_logps": x["old"], "num_items_in_batch": x["mask"].sum()}
    loss = GRPOTrainer._compute_loss(stub, None, batch)
    loss.backward()
    return loss.detach(), logps.grad


def alignkit_loss(x: dict[str, torch.Tensor], case: str) -> tuple[torch.Tensor, torch.Tensor]:
    keep = x["mask"].bool()
    logps = x["logps"].clone().requires_grad_()
    seq = torch.arange(B).unsqueeze(1).expand(B, T)[keep]
    flat_logps, old, adv = logps[keep], x["old"][keep], x["adv"].unsqueeze(1).expand(B, T)[keep]
    tokens = float(keep.sum())
    if case == "cispo":
        per_token, _ = cispo_loss(flat_logps, old, adv, eps_low=1.0, eps_high=4.0)
        loss = aggregate(per_token, seq, B, mode="token_mean", normalizer=tokens)
    elif case == "gspo":
        per_token, _ = clipped_surrogate(flat_logps, old, adv, eps_low=0.2, eps_high=0.2, seq=seq, num_seqs=B,
                                         level="sequence")
        loss = aggregate(per_token, seq, B, mode="sequence_mean", normalizer=B)
    else:
        per_token, _ = clipped_surrogate(flat_logps, old, adv, eps_low=0.2, eps_high=0.28)
        loss = aggregate(per_token, seq, B, mode="token_mean", normalizer=tokens)
    loss.backward()
    return loss.detach(), logps.grad


def gkd(beta: float, seed: int = 1) -> dict[str, float]:
    from trl.experimental.gkd import GKDTrainer

    g = torch.Generator().manual_seed(seed)
    student, teacher = 2 * torch.randn(B, T, V, generator=g), 2 * torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :2] = -100
    s_trl = student.clone().requires_grad_()
    trl = GKDTrainer.generalized_jsd_loss(s_trl, teacher, labels=labels, beta=beta)
    trl.backward()
    s_ak = student.clone().requires_grad_()
    keep = labels != -100
    ours = generalized_jsd(torch.log_softmax(s_ak, -1)[keep], torch.log_softmax(teacher, -1)[keep], beta=beta).mean()
    ours.backward()
    trl, ours = trl.detach(), ours.detach()
    return {"loss": float(trl), "loss_diff": float((trl - ours).abs()), "grad_diff": float((s_trl.grad - s_ak.grad).abs().max())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    x = inputs()
    report: dict[str, dict[str, float]] = {}
    for case, (loss_type, level, eps_high) in {"dapo_clip_higher": ("dapo", "token", 0.28), "gspo": ("grpo", "sequence", 0.2),
                                              "cispo": ("cispo", "token", 5.0)}.items():
        trl, trl_grad = trl_grpo_loss(x, loss_type, level, 0.2, eps_high)
        ours, grad = alignkit_loss(x, case)
        report[case] = {"loss": float(trl), "loss_diff": float((trl - ours).abs()),
                        "grad_diff": float((trl_grad - grad).abs().max())}
    for beta in (0.0, 0.5, 1.0):
        report[f"gkd_beta{beta:g}"] = gkd(beta)
    print(json.dumps(report, indent=1))
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
