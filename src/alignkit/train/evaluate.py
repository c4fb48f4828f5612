"""``alignkit eval CONFIG``: the algorithm's evaluation metrics of a model on ``data.eval``.

Runs alone or under a launcher; every example is evaluated exactly once across ranks (the loop's
``EvalSampler``) and sums/counts are reduced before dividing. For a reward/cost model that is
pairwise accuracy and mean margin; for DPO the implicit-reward accuracy, margins and KL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from alignkit.algorithms import ALGORITHMS
from alignkit.config import RunConfig
from alignkit.distributed.env import read_env
from alignkit.distributed.strategy import build_strategy
from alignkit.errors import ConfigError
from alignkit.logging import setup_console
from alignkit.models.loading import load_tokenizer
from alignkit.train.offline_loop import OfflineTrainer


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


def run_eval(cfg: RunConfig, model_dir: str | None = None, out: str | None = None) -> dict[str, float]:
    env = read_env()
    setup_console(env.is_main)
    if not cfg.data.eval:
        raise ConfigError("data.eval: alignkit eval needs one or more evaluation files")
    evaluated = pick_model(cfg, model_dir)
    strategy = build_strategy(cfg, env)
    strategy.setup()
    algo = ALGORITHMS.get(cfg.algorithm)(cfg, load_tokenizer(cfg.model))
    eval_set = algo.build_dataset(cfg.data.eval, "eval")
    if not eval_set:
        raise ConfigError(f"data.eval: no usable examples in {cfg.data.eval}")
    # evaluation only: no optimizer and no gradient-sync wrapper, just the replicated model
    model = strategy.prepare_frozen(algo.build_policy(torch.float32))
    algo.build_frozen(strategy)
    algo.before_training(model, [], eval_set, strategy)
    trainer = OfflineTrainer(cfg, algo, strategy, logger=None)  # type: ignore[arg-type]
    trainer.eval_set = eval_set
    metrics = trainer.evaluate(model)
    metrics["examples"] = float(len(eval_set))
    if strategy.is_main:
        skipped = algo.skipped.get("eval", 0)
        lines = [f"eval of {evaluated} ({cfg.algorithm}) on {', '.join(cfg.data.eval)}: {len(eval_set)} examples"
                 + (f" ({skipped} invalid rows skipped)" if skipped else "")]
        lines += [f"  {k:<20} {v:.4f}" for k, v in sorted(metrics.items()) if k != "examples"]
        print("\n".join(lines), flush=True)
        if out:
            Path(out).write_text(json.dumps({"model": evaluated, **metrics}) + "\n", encoding="utf-8")
    return metrics


def eval_command(config: str, overrides: list[str], model_dir: str | None, out: str | None) -> dict[str, Any]:
    from alignkit.config import load_config

    return run_eval(load_config(config, overrides), model_dir, out)
