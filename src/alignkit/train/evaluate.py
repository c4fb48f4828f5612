"""Evaluation: the algorithm's metrics over a data set, and ``alignkit eval CONFIG``.

:func:`evaluate` runs over (algorithm, models, examples, strategy): every example is evaluated exactly
once across ranks (``EvalSampler``) and sums/counts are reduced before dividing. For a reward/cost
model that is pairwise accuracy and mean margin; for DPO the implicit-reward accuracy, margins and KL.
The training loop and ``alignkit eval`` both call it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader

import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections: eval_command loads a config)
from alignkit.algorithms.base import Context, Example, OfflineAlgorithm
from alignkit.config import RunConfig, load_config
from alignkit.data.sampler import EvalSampler
from alignkit.distributed import comm
from alignkit.distributed.strategy.base import Strategy
from alignkit.errors import ConfigError
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


def pick_model(cfg: RunConfig, model_dir: str | None) -> str:
    """The model to evaluate: ``--model``, else ``output_dir/final`` if training wrote one, else the config's.

    When it is not the config's own model, the config's model becomes the reference
    (``model.ref_name_or_path``, unless set): DPO's implicit rewards compare against the start.
    """
    final = Path(cfg.output_dir) / "final"
    chosen = model_dir or (str(final) if (final / "config.json").is_file() or (final / "adapter_config.json").is_file() else None)
    if chosen is None:
        return cfg.model.name_or_path
    if not Path(chosen).exists():
        raise FileNotFoundError(f"--model {chosen!r} does not exist")
    if cfg.model.ref_name_or_path is None:
        cfg.model.ref_name_or_path = cfg.model.name_or_path
    cfg.model.name_or_path = chosen
    return chosen


def run_eval(cfg: RunConfig, model_dir: str | None = None, out: str | None = None, *, show: bool = True) -> dict[str, float]:
    from alignkit.train.runner import Session

    if not cfg.data.eval:
        raise ConfigError("data.eval: alignkit eval needs one or more evaluation files")
    evaluated = pick_model(cfg, model_dir)
    session = Session.start(cfg)
    algo, strategy = session.algo, session.strategy
    eval_set = algo.data.build_dataset(cfg.data.eval, "eval")
    if not eval_set:
        raise ConfigError(f"data.eval: no usable examples in {cfg.data.eval}")
    # evaluation only: no optimizer and no gradient-sync wrapper, just the replicated models
    models = session.build_models(train=False)
    algo.before_training(Context(models, strategy), [], eval_set)
    t = cfg.training
    metrics = evaluate(algo, models, eval_set, strategy, batch_size=t.eval_batch_size or t.per_device_batch_size or 8)
    metrics["examples"] = float(len(eval_set))
    if strategy.is_main and show:
        skipped = algo.data.skipped.get("eval", 0)
        lines = [f"eval of {evaluated} ({cfg.algorithm}) on {', '.join(cfg.data.eval)}: {len(eval_set)} examples"
                 + (f" ({skipped} invalid rows skipped)" if skipped else "")]
        lines += [f"  {k:<20} {v:.4f}" for k, v in sorted(metrics.items()) if k != "examples"]
        print("\n".join(lines), flush=True)
        if out:
            Path(out).write_text(json.dumps({"model": evaluated, **metrics}) + "\n", encoding="utf-8")
    return metrics


def eval_command(config: str, overrides: list[str], model_dir: str | None, out: str | None) -> dict[str, Any]:
    return run_eval(load_config(config, overrides), model_dir, out)
