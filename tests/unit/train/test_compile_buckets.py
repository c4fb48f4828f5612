"""Regional compile (``training.torch_compile``) of packed rows whose length changes every step: the blocks compile
once per bucket of ``data.pack_multiple_of`` tokens with static shapes, or once in all with dynamic shapes. A
packed row's boundaries reach the attention as one opaque input (``models.attention.PackedRow``), so a new number
of examples or a new longest one does not recompile a block (before it did, on every new count, until torch's
recompile limit sent the blocks back to eager). Compiled with the ``eager`` backend: dynamo's graph capture and
guards are what is counted, at CPU speed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from alignkit.constants import IGNORE_INDEX
from alignkit.data.collate import PACKED_SEQ_LENS, TokenCollator
from alignkit.models import attention
from alignkit.train.runner import compile_decoder_blocks

STEPS = 8


def _rows(vocab: int, multiple: int) -> list[dict]:
    """STEPS packed rows of 2-6 examples of 20-120 tokens each (lengths ~150-450: 2 buckets of 256)."""
    rng, rows = random.Random(0), []
    collate = TokenCollator(0, packed=True, multiple=multiple)
    for _ in range(STEPS):
        sizes = [rng.randint(20, 120) for _ in range(rng.randint(2, 6))]
        rows.append(collate([{"input_ids": [rng.randrange(vocab) for _ in range(n)], "labels": [1] * n}
                             for n in sizes]))
    return rows


def _graphs_per_step(micro_model: Path, *, dynamic: bool, multiple: int) -> tuple[list[int], list[int]]:
    """(dynamo's unique graphs after each step, each step's row length)."""
    torch._dynamo.reset()
    counters.clear()
    model = AutoModelForCausalLM.from_pretrained(str(micro_model), attn_implementation=attention.register())
    compile_decoder_blocks(model, dynamic=dynamic, backend="eager")
    graphs, lengths = [], []
    for batch in _rows(model.config.vocab_size, multiple):
        inputs = attention.packed_model_inputs(model, batch.model_inputs(), torch.device("cpu"))
        model(**inputs, use_cache=False).logits.float().sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
        lengths.append(batch["input_ids"].shape[1])
    return graphs, lengths


@pytest.mark.slow(seconds=40)
def test_static_shapes_compile_once_per_bucket(micro_model: Path) -> None:
    graphs, lengths = _graphs_per_step(micro_model, dynamic=False, multiple=256)
    assert all(n % 256 == 0 for n in lengths)
    buckets = len(set(lengths))
    assert buckets == 2, lengths  # the rows (151-401 tokens) fall into the 256 and 512 buckets
    per_compile = graphs[0]  # a block's graphs (the attention is a graph break)
    assert graphs[-1] == per_compile * buckets, (graphs, lengths)  # one compile per bucket, none per step


@pytest.mark.slow(seconds=40)
def test_dynamic_shapes_compile_once_for_every_length(micro_model: Path) -> None:
    graphs, lengths = _graphs_per_step(micro_model, dynamic=True, multiple=1)
    assert len(set(lengths)) == STEPS  # every step a new length and (mostly) a new number of examples
    assert graphs == [graphs[0]] * STEPS, graphs


def test_a_bucketed_row_pads_with_one_segment_no_loss_reads() -> None:
    batch = TokenCollator(7, packed=True, multiple=8)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
                                                       {"input_ids": [4, 5], "labels": [-100, 5]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 7, 7, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["seq_index"].tolist() == [[0, 0, 0, 1, 1, -1, -1, -1]]
    assert batch["targets"].tolist() == [[2, 3, IGNORE_INDEX, 5, IGNORE_INDEX] + [IGNORE_INDEX] * 3]
    assert batch[PACKED_SEQ_LENS] == (3, 2, 3) and batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    exact = TokenCollator(7, packed=True, multiple=8)([{"input_ids": list(range(8)), "labels": list(range(8))}])
    assert exact[PACKED_SEQ_LENS] == (8,)  # already a multiple: no padding segment
