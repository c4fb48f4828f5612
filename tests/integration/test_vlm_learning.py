"""The tiny VLM learns the shapes task: LLaVA-style pretrain (projector only) then sft (projector + LM) of a
random micro LLaVA, then greedy answers to held-out scenes judged by the program (slow).

Pipeline (configs/vlm_pretrain.yaml + configs/vlm_sft.yaml as shipped, on this test's model and data): 2000
caption rows for pretrain (1 epoch, lr 1e-3); sft on 3000 question rows (2-3 questions each) plus the caption
rows (as LLaVA mixes its instruction data), 24 epochs, lr 1e-3, cosine; 200 held-out eval rows (layouts never
seen in training), one question each. The micro LLaVA's vision tower starts with identity layers
(models/tiny_vlm.py says why).

Measured (this machine, 2 shared CPU cores, one thread; greedy exact match on 200 held-out rows;
``colour_shape`` = colour and shape questions together, the issue's measure):

    seed  colour_shape  colour  shape  where  count   all   CPU
    0        1.000      1.000   1.000  0.860  1.000  0.965  490 s
    1        0.968      0.940   1.000  0.914  1.000  0.960  538 s
    2        0.949      0.896   1.000  0.915  1.000  0.950  504 s
    3        1.000      1.000   1.000  0.981  1.000  0.995  515 s
    4        1.000      1.000   1.000  1.000  1.000  1.000  491 s
    5        0.990      0.977   1.000  1.000  1.000  0.995  520 s
    6        1.000      1.000   1.000  0.979  1.000  0.995  471 s

Counting is learned first; an object's shape is recognised from its patch tokens (a probe on the frozen
tower's features: 100% held-out); what takes long is binding in two- and three-object scenes ("What colour
is the circle?" must find the circle's tokens and read their colour). That emerges around epoch 8-10 at
lr 1e-3, later on some seeds: with 16 epochs seeds 0-3 reached 0.99-1.00 but seed 4 0.883 and seed 5 0.725
(binding not yet learned), and full multi-head attention in the LM (4 key/value heads, not 2) was no cure
(seed 4 1.000 but seed 0 0.873); with 24 epochs every seed above passes. At lr 3e-3 binding never emerged (8 epochs,
random tower layers: 0.68-0.89). The pretrain stage alone teaches the frozen random LM nothing (caption loss
6.88 -> 6.83): it matters with a pretrained LM, as in LLaVA.

Where the time goes (CPU s of the runs below): model + data 2-3, projector pretrain 4-7 (500-1000 rows, 1
epoch), evaluation 1 (200 rows, batched greedy), the sft stage the rest (~95%): the cost is the number of sft
examples (~4 ms each at batch 16, ~6 ms at batch 8). Cheaper recipes tried for a ~150 s test (2026-11-29, seed
5, the slowest above; batch 8, whose step costs 0.59x batch 16's; 3000 question rows, 3000 steps = ~24k examples
against the 120k here; 200 held-out rows; CPU s of the whole run):

    pretrain rows  caption mix  objects  lr     colour_shape  shape  all    CPU
    500            no           1-3      1e-3   0.529         0.362  0.680  156 s
    500            no           1-3      2e-3   0.657         0.569  0.755  154 s
    1000           yes          1-3      2e-3   0.598         0.500  0.720  155 s
    1000           yes          1-2      2e-3   0.510         0.310  0.680  154 s

Per-epoch checkpoints: counting learned by epoch 2-4, shape questions near chance (0.33) until the last epochs,
where the 2e-3 runs had just begun to rise: binding emerges after ~40-50k examples even on the quick seeds
(epoch 8-10 above), so a run under ~150 s needs a model or task that binds sooner, not a shorter schedule.
The collator reads each image once (``data.vlm.PixelCache``, the same tensors): seed 0 the same numbers, CPU 545 ->
514 s (2026-11-29, a loaded machine: colour_shape 0.961, shape 0.905, where 0.920, all 0.960 on both, where the
table above has seed 0 at 1.000 / 1.000 / 0.860 / 0.965: the code or library versions moved since it was measured).
The assertions hold the issue's bar (90% on colour/shape) and the measured minimum minus a margin elsewhere.
``ALIGNKIT_LEARN_SEED=N`` re-measures one seed; run with -s to see the numbers.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.slow(seconds=330)

PATCH = 8


def _learn(seed: int, root: Path) -> tuple[dict[str, float], float]:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from alignkit.config import load_config
    from alignkit.data.synth_vlm import generate_vlm
    from alignkit.models.tiny_vlm import build_tiny_llava
    from alignkit.rollout.vlm_generate import shapes_accuracy
    from alignkit.train.runner import run_train

    t0 = time.process_time()
    model = build_tiny_llava(root / "model", size="micro", seed=seed, patch_size=PATCH)
    d = root / "data"
    generate_vlm(2000, seed, d / "pretrain.json", stage="pretrain", split="train")
    generate_vlm(3000, seed + 100, d / "sft.json", stage="sft", split="train")
    generate_vlm(200, seed + 200, d / "eval.json", stage="sft", split="eval")
    # the shipped recipe (lr, epochs, batch, warmup, max_length, padding), pointed at this test's model and data
    run = [f"model.name_or_path={model}", f"training.seed={seed}", "data.image_root=null", "data.eval=[]",
           "training.eval_steps=null", "checkpoint.save_steps=null", "logging.report_to=[jsonl]", "logging.plot=false",
           "distributed.strategy=single"]
    configs = REPO / "configs"
    run_train(load_config(configs / "vlm_pretrain.yaml",
                          [*run, f"output_dir={root / 'pre'}", f"data.train={d / 'pretrain.json'}"]))
    run_train(load_config(configs / "vlm_sft.yaml",
                          [*run, f"vlm.projector_from={root / 'pre' / 'final'}", f"output_dir={root / 'sft'}",
                           f"data.train=[{d / 'sft.json'},{d / 'pretrain.json'}]"]))
    final = root / "sft" / "final"
    acc = shapes_accuracy(LlavaForConditionalGeneration.from_pretrained(final), AutoProcessor.from_pretrained(final),
                          json.loads((d / "eval.json").read_text()), str(d))
    return acc, time.process_time() - t0


def test_pretrain_then_sft_answers_held_out_shape_questions(tmp_path: Path) -> None:
    seed = int(os.environ.get("ALIGNKIT_LEARN_SEED", "0"))
    torch.set_num_threads(int(os.environ.get("ALIGNKIT_LEARN_THREADS", "1")))
    acc, cpu = _learn(seed, tmp_path)
    print(f"\nseed {seed}: {json.dumps({k: round(v, 3) for k, v in acc.items()})}, CPU {cpu:.0f} s")
    assert acc["count"] >= 0.9  # measured 1.000 on every seed
    assert acc["colour_shape"] >= 0.90  # the bar; measured 0.949 .. 1.000
    assert acc["all"] >= 0.85  # measured 0.950 .. 1.000
