"""``alignkit prepare CONFIG`` (and ``scripts/prepare_datasets.py --config CONFIG``): read and tokenise
the config's data sets into the cache ahead of training, so every later run (and every rank of it)
starts by memory-mapping them."""

from __future__ import annotations

import argparse
import time

from alignkit.algorithms import ALGORITHMS
from alignkit.config import load_config
from alignkit.data.assemble import cache_root
from alignkit.logging import setup_console
from alignkit.models.loading import load_tokenizer


def cmd_prepare(args: argparse.Namespace) -> int:
    prepare_command(args.config, args.overrides)
    return 0


def prepare_command(config: str, overrides: list[str]) -> list[str]:
    """Prepare data.train and data.eval; returns (and prints) one line per split and the cache folder."""
    cfg = load_config(config, overrides)
    setup_console(True)
    algo = ALGORITHMS.get(cfg.algorithm)(cfg, load_tokenizer(cfg.model))
    out = []
    for split, specs, name in (("train", cfg.data.train, "training"), ("eval", cfg.data.eval, "evaluation")):
        if not specs:
            continue
        if split == "train" and cfg.data.streaming:
            out.append("train: data.streaming is on: the training data is read as a stream, nothing to prepare")
            continue
        start = time.perf_counter()
        examples = algo.data.build_dataset(specs, split)
        out.append(f"{split}: {len(examples)} examples from {', '.join(specs)} in {time.perf_counter() - start:.1f}s")
        out += [f"  {line}" for line in algo.data.row_counts[split].lines(name)] if split in algo.data.row_counts else []
    out.append(f"cache: {cache_root(cfg.data.cache_dir)} (data.num_proc={cfg.data.num_proc})")
    for line in out:
        print(line, flush=True)
    return out
