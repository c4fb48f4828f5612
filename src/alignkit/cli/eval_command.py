"""``alignkit eval CONFIG``: the algorithm's metrics (:func:`alignkit.train.evaluate.evaluate`) of a model on the
config's ``data.eval``: the run's final model, ``--model``, or the config's own (``cli/parser.py`` holds its
arguments)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections)
from alignkit.algorithms.base import Context
from alignkit.config import RunConfig, load_config
from alignkit.errors import ConfigError
from alignkit.train.evaluate import evaluate
from alignkit.train.runner import Session


def cmd_eval(args: argparse.Namespace) -> int:
    eval_command(args.config, args.overrides, args.model, args.out)
    return 0


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
