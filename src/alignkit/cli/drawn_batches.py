"""The largest micro-batch a run will draw, read off its prepared (or cheaply tokenised) training data.

The estimator's worst case is ``per_device_batch_size x max_length`` tokens per sequence slot, but real
micro-batches are shorter: a packed row holds the sum of its examples' lengths, a padded batch ``B x`` its
longest example. When the run's data is on local disk (or already in the Arrow cache) this module tokenises it
as ``alignkit train`` would (:meth:`DataPipeline.build_dataset`, the same cache), replays the run's global order
(:class:`~alignkit.data.sampler.GlobalOrder`, same seed, every rank) for the steps the run takes, and returns the
tokens of the largest micro-batch any rank draws. Anything it cannot read (a Hub dataset, streaming, a
pipeline it does not know) returns None with the reason, and the estimator keeps the worst case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignkit.algorithms import ALGORITHMS
from alignkit.config.loader import resolve_batch
from alignkit.config.schema import RunConfig
from alignkit.constants import BUILTIN_PREFIX
from alignkit.data.pipelines import PairData, TokenData
from alignkit.data.sampler import GlobalOrder
from alignkit.models.loading import load_tokenizer
from alignkit.train.run_plan import plan_steps

#: epochs of the run's order replayed at most (a long multi-epoch run is sized from its first ones)
MAX_EPOCHS = 10


@dataclass(frozen=True)
class DrawnBatches:
    """``tokens``: the largest micro-batch's tokens (every sequence of it, padding included when padded);
    ``micro_batches``: how many micro-batches per rank were replayed; ``examples``: the training set's size."""

    tokens: int
    micro_batches: int
    examples: int
    packed: bool


def sequence_lengths(example: dict[str, Any]) -> list[int]:
    """Lengths of the sequences one example puts through the model: ``input_ids`` (SFT) or the chosen and
    rejected ids of a pair."""
    return [len(v) for k, v in example.items() if (k == "input_ids" or k.endswith("_ids")) and hasattr(v, "__len__")]


def micro_batch_tokens(examples: Sequence[dict[str, Any]], packed: bool) -> int:
    """Tokens the model sees for ``examples``: their sum in a packed row, else ``sequences x longest``."""
    lengths = [n for e in examples for n in sequence_lengths(e)]
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def _local(spec: str) -> bool:
    return spec.startswith(BUILTIN_PREFIX) or Path(spec).expanduser().exists()


def _packed(data: Any) -> bool | None:
    """Whether the pipeline packs a micro-batch into one row (pairs always are); None = a pipeline not sized here."""
    if isinstance(data, PairData):  # VLM pairs carry images: their tokens are not the whole story
        return True if data.processor is None else None
    if isinstance(data, TokenData):
        return bool(data.cfg.packing)
    return None


def drawn_batches(cfg: RunConfig, n_gpus: int) -> tuple[DrawnBatches | None, str]:
    """The largest micro-batch of ``cfg``'s run on ``n_gpus`` ranks, or None and why not."""
    d = cfg.data
    if d.streaming:
        return None, "data.streaming: the rows are read as a stream"
    hub = [s for s in d.train if not _local(s)]
    if hub:
        return None, f"{hub[0]} is not a local file (a Hub dataset is not downloaded to estimate)"
    try:
        algo = ALGORITHMS.get(cfg.algorithm)(cfg, load_tokenizer(cfg.model))
        data = getattr(algo, "data", None)
        packed = _packed(data)
        if packed is None:
            return None, f"the {cfg.algorithm} data pipeline's micro-batches are not sized here"
        examples = data.build_dataset(d.train, "train")
    except Exception as e:  # noqa: BLE001 - any failure to read the data means: keep the worst case
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"the training data could not be read ({first})"
    batch = resolve_batch(cfg, n_gpus)
    return _replay(examples, batch.per_device, batch.accumulation, n_gpus, cfg, packed), ""


def _replay(examples: Any, per_device: int, accumulation: int, world: int, cfg: RunConfig,
            packed: bool) -> DrawnBatches:
    """Walk the run's micro-batches on every rank (epochs as the loop does) and keep the largest."""
    n = len(examples)
    steps = plan_steps(n, per_device, accumulation, world, cfg.training)
    want = steps.total * accumulation  # micro-batches per rank the run draws (fewer at an epoch's end: an upper bound)
    orders = [GlobalOrder(n, world, r, per_device, seed=cfg.training.seed) for r in range(world)]
    # each epoch is a new permutation; past MAX_EPOCHS the largest micro-batch hardly grows and replaying costs time
    epochs = min(MAX_EPOCHS, -(-want // steps.micro_per_epoch))
    biggest, drawn = 0, 0
    for epoch in range(epochs):
        rounds = [o.rounds(epoch) for o in orders]
        for per_rank in zip(*rounds):
            if drawn >= want:
                break
            drawn += 1
            for indices, _ in per_rank:
                biggest = max(biggest, micro_batch_tokens([examples[i] for i in indices], packed))
    return DrawnBatches(biggest, drawn, n, packed)
