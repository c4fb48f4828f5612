"""Evaluation: the algorithm's metrics over a data set (``alignkit eval CONFIG``: ``cli/eval_command.py``).

:func:`evaluate` runs over (algorithm, models, examples, strategy): every example is evaluated exactly
once across ranks (``EvalSampler``) and sums/counts are reduced before dividing. For a reward/cost
model that is pairwise accuracy and mean margin; for DPO the implicit-reward accuracy, margins and KL.
The training loop and ``alignkit eval`` both call it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import DataLoader

from alignkit.algorithms.base import Example, OfflineAlgorithm
from alignkit.data.sampler import EvalSampler
from alignkit.distributed import comm
from alignkit.distributed.strategy.base import Strategy
from alignkit.metrics import MetricSums
from alignkit.models.roles import Models
from alignkit.progress import track


@torch.no_grad()
def evaluate(algo: OfflineAlgorithm, models: Models, eval_set: list[Example], strategy: Strategy, *,
             batch_size: int) -> dict[str, float]:
    """Global means of ``algo.eval_step``'s metrics over ``eval_set``."""
    loader = DataLoader(eval_set, batch_size=batch_size, collate_fn=algo.data.collate,
                        sampler=EvalSampler(len(eval_set), strategy.dp_size, strategy.dp_rank))
    was_training = {role: h.module.training for role, h in models.handles.items()}
    models.train(False)
    sums = MetricSums()
    # Sharded engines (FSDP2, ZeRO-3) gather weights inside forward, so every rank must run
    # as many forwards as the busiest one: ranks with fewer eval batches run discarded extras.
    most = int(comm.all_reduce_max(torch.tensor(float(len(loader)), device=strategy.device)).item())
    for batch in track(loader, len(loader), "evaluating", "batches"):
        batch = batch.to(strategy.device)
        with strategy.autocast():
            sums.merge(algo.eval_step(models, batch))
    if most > len(loader):
        filler = algo.data.collate([eval_set[0]]).to(strategy.device)
        for _ in range(most - len(loader)):
            with strategy.autocast():
                algo.eval_step(models, filler)
    for role, mode in was_training.items():
        models.handles[role].module.train(mode)
    return comm.reduce_metrics(sums.sums, sums.counts)


def evaluate_at_start(run: Callable[[int], dict[str, float]], *, enabled: bool, step: int) -> dict[str, float]:
    """``training.eval_before_train``: the eval of the untrained model, logged as step 0 by ``run`` (the loop's
    own eval), so eval curves start where training starts. Not on a resumed run (``step`` > 0: its step 0 is
    in its metrics.jsonl already). Under a forked CPU random state: a DataLoader draws its base seed from the
    global generator, and training must not depend on whether this eval ran."""
    if not enabled or step != 0:
        return {}
    with torch.random.fork_rng(devices=[]):
        return run(0)
