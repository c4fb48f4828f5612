"""SFT that records which training examples each rank trains on (see test_world_size_resume.py).

Usage: ``[torchrun --nproc_per_node=N] record_examples.py MODEL_DIR OUT_DIR LOG_DIR MAX_STEPS [RESUME]``
Each rank appends ``{"step": s, "ids": [...]}`` lines to LOG_DIR/rank{r}.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from alignkit.algorithms import ALGORITHMS
from alignkit.algorithms.sft import SFT
from alignkit.config import RunConfig, load_config
from alignkit.data.examples import set_fields
from alignkit.distributed.comm import exit_process
from alignkit.train.runner import run_train


class Recorded(SFT):
    name = "recorded_sft_test"
    log: Path

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer)
        build, collate = self.data.build_dataset, self.data.collate

        def build_dataset(specs: list[str], split: str) -> list[dict[str, Any]]:
            examples = build(specs, split)
            for i in range(len(examples)):
                set_fields(examples, i, example_id=i)  # the collators ignore fields they do not know
            return examples

        def record(examples: list[dict[str, Any]]) -> Any:
            with Recorded.log.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps({"ids": [e["example_id"] for e in examples]}) + "\n")
            return collate(examples)

        self.data.build_dataset, self.data.collate = build_dataset, record  # type: ignore[method-assign]


def main(model_dir: str, out: str, log_dir: str, max_steps: str, resume: str = "") -> None:
    Recorded.log = Path(log_dir) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    ALGORITHMS.register("recorded_sft_test")(Recorded)
    cfg = load_config(None, [
        "algorithm=recorded_sft_test", f"model.name_or_path={model_dir}", f"output_dir={out}",
        "data.train=builtin:sft_train.jsonl", "data.max_length=48", "data.max_train_examples=48",
        "training.per_device_batch_size=4", f"training.max_steps={max_steps}", "training.learning_rate=1e-3",
        "logging.report_to=[jsonl]", "logging.plot=false", "checkpoint.save_steps=1", "distributed.strategy=auto",
        *([f"checkpoint.resume_from={resume}"] if resume else []),
    ])
    run_train(cfg)


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_process(0, barrier=True)
