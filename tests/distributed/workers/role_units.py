"""Run under torchrun with 2 processes (gloo, DDP) or alone: ``train/step.accumulate`` with per-role loss units.

Two trained roles (``policy``: a (3,) weight, ``image_policy``: a (2,) weight) and one optimizer step of 3
micro-batches per rank in flow_rtpo's layout: the policy's units only in micro-batch 0, the image policy's in
1 and 2 (another count per rank). Each role's gradient must be the sum over EVERY rank's units of that role
divided by that role's global unit count, on every rank: a role whose last micro-batch is not the step's last
must still sync (a wrong no_sync leaves it local), and the normaliser must be per role (a shared one mixes the
counts). Prints ``role units ok`` on success."""

from __future__ import annotations

import torch
from torch import nn

from alignkit.config.schema import DistributedConfig
from alignkit.data.batch import Batch
from alignkit.distributed import comm
from alignkit.distributed.comm import exit_process
from alignkit.distributed.env import read_env
from alignkit.distributed.strategy import build_strategy
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models


class Weight(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w  # (B,)


def rows(rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches: policy rows (B, 3) in the first, image rows (B, 2) in the other two."""
    g = torch.Generator().manual_seed(rank)
    n_img = 2 + rank  # rank 1 holds more image units than rank 0
    return [{"p": torch.randn(2, 3, generator=g)}, {"i": torch.randn(n_img, 2, generator=g)},
            {"i": torch.randn(1, 2, generator=g)}]


def main() -> None:
    from alignkit.train.step import accumulate

    env = read_env()
    strategy = build_strategy("ddp", DistributedConfig(), env, "fp32")
    strategy.setup()
    rank = strategy.dp_rank
    models = Models()
    for role, n in (("policy", 3), ("image_policy", 2)):
        models.handles[role] = strategy.prepare(Weight(n), lambda m: torch.optim.SGD(m.parameters(), lr=0.0), role=role)
    group = [Batch({}, mb) for mb in rows(rank)]

    def loss(models: Models, batch: Batch, *, normalizer: dict[str, float]) -> tuple[dict[str, torch.Tensor], MetricSums]:
        out = {}
        if "p" in batch:
            out["policy"] = models["policy"](batch["p"]).sum() / normalizer["policy"]
        if "i" in batch:
            out["image_policy"] = models["image_policy"](batch["i"]).sum() / normalizer["image_policy"]
        return out, MetricSums()

    def units(batch: Batch) -> dict[str, int]:
        return {"policy": batch["p"].shape[0] if "p" in batch else 0, "image_policy": batch["i"].shape[0] if "i" in batch else 0}

    accumulate(strategy, models, group, loss, units, lambda b: 0)
    everyone = [mb for r in range(strategy.dp_size) for mb in rows(r)]
    p = torch.cat([mb["p"] for mb in everyone if "p" in mb])
    i = torch.cat([mb["i"] for mb in everyone if "i" in mb])
    want = {"policy": p.sum(0) / p.shape[0], "image_policy": i.sum(0) / i.shape[0]}
    for role, grad in want.items():
        got = strategy.unwrap(models[role]).w.grad
        assert torch.allclose(got, grad, atol=1e-6), (rank, role, got, grad)
    same = comm.all_gather_object({r: strategy.unwrap(models[r]).w.grad.tolist() for r in want})
    assert all(s == same[0] for s in same), same
    print("role units ok", flush=True)
    exit_process(0, barrier=True)


if __name__ == "__main__":
    main()
