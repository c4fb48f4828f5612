"""data.streaming: rows shared round-robin by ranks, positions that resume exactly (also across an
epoch's end), and a streamed training run resumed from a checkpoint repeating the uninterrupted
run's losses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from alignkit.config import load_config
from alignkit.data.io import Row
from alignkit.data.streaming import RowStream
from alignkit.errors import ConfigError, DataError


def _file(path: Path, n: int, bad: tuple[int, ...] = ()) -> Path:
    lines = []
    for i in range(n):
        lines.append("{not json" if i in bad else json.dumps({"prompt": f"q{i}?", "completion": f"a{i}."}))
        if i == 3:
            lines.append("")  # a blank line: no row
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ident(row: Row) -> dict[str, Any]:
    return {"prompt": row.data["prompt"], "line": row.line}


def test_ranks_share_rows_and_resume_exactly(tmp_path: Path) -> None:
    f = _file(tmp_path / "a.jsonl", 11)
    g = _file(tmp_path / "b.jsonl", 4)
    streams = [RowStream([str(f), str(g)], ident, rank=r, world=2, skip_invalid=False) for r in (0, 1)]
    firsts = [[e["prompt"] for e in s.next_examples(7)] for s in streams]  # 15 rows: past the end of a pass
    assert firsts[0][:4] == ["q0?", "q2?", "q4?", "q6?"] and firsts[1][:4] == ["q1?", "q3?", "q5?", "q7?"]
    # one pass is 15 rows (g = 0..10 in a.jsonl, 11..14 in b.jsonl): rank 0 owns 8 of them, rank 1 owns 7
    assert firsts[0][4:] == ["q8?", "q10?", "q1?"] and firsts[1][4:] == ["q9?", "q0?", "q2?"]
    assert streams[0].next_examples(1)[0] == {"prompt": "q3?", "line": 4}  # g = 14, the pass's last row
    assert streams[1].next_examples(1)[0]["prompt"] == "q1?"  # rank 1's pass is over: epoch 1, g = 1
    assert streams[1].pos.epoch == 1 and streams[0].pos.epoch == 0
    saved = [s.state() for s in streams]
    rest = [[e["prompt"] for e in s.next_examples(9)] for s in streams]
    for r in (0, 1):
        again = RowStream([str(f), str(g)], ident, rank=r, world=2, skip_invalid=False)
        again.restore(saved)
        assert [e["prompt"] for e in again.next_examples(9)] == rest[r]
    with pytest.raises(ConfigError, match="positions are for 2 ranks, this run has 3"):
        RowStream([str(f)], ident, rank=0, world=3, skip_invalid=False).restore(saved)


def test_malformed_rows_in_a_stream(tmp_path: Path) -> None:
    f = _file(tmp_path / "a.jsonl", 6, bad=(2,))
    with pytest.raises(DataError, match=rf"^{f}:3: not valid JSON"):
        RowStream([str(f)], ident, rank=0, world=1, skip_invalid=False).next_examples(6)
    s = RowStream([str(f)], ident, rank=0, world=1, skip_invalid=True)
    assert [e["line"] for e in s.next_examples(5)] == [1, 2, 4, 6, 7]  # line 5 is blank
    assert s.counts.dropped == {"not valid JSON": 1}


def _run(model: Path, out: Path, data: Path, **extra: Any) -> list[float]:
    from alignkit.train.runner import run_train

    over = [f"{k}={v}" for k, v in extra.items()]
    cfg = load_config(None, ["algorithm=sft", f"model.name_or_path={model}", f"output_dir={out}",
                             f"data.train={data}", "data.streaming=true", "data.max_length=24",
                             "data.skip_invalid=true", "training.per_device_batch_size=4", "training.max_steps=8",
                             "training.learning_rate=1e-3", "training.lr_scheduler=constant", "training.seed=0",
                             "logging.report_to=[jsonl]", "logging.plot=false", "checkpoint.save_final=false",
                             *over], notes=False)
    return run_train(cfg).losses


def test_streamed_run_resumes_exactly(micro_model: Path, tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    data = _file(tmp_path / "s.jsonl", 18, bad=(5,))  # 17 usable rows: an epoch ends in step 5
    full = _run(micro_model, tmp_path / "a", data, **{"checkpoint.save_steps": 3})
    ckpt = tmp_path / "a" / "checkpoint-3"
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    assert saved["stream"] == [{"epoch": 0, "source": 0, "offset": saved["stream"][0]["offset"], "line": 15,
                                "row": 13}]  # 12 examples, the bad row and a blank line read
    shutil.copytree(ckpt, tmp_path / "b" / "checkpoint-3")
    resumed = _run(micro_model, tmp_path / "b", data, **{"checkpoint.resume_from": "latest"})
    assert len(full) == 8 and len(resumed) == 5
    assert resumed == pytest.approx(full[3:], rel=1e-6, abs=1e-7)


def test_streaming_needs_max_steps() -> None:
    with pytest.raises(ConfigError, match="data.streaming: needs training.max_steps"):
        load_config(None, ["algorithm=sft", "model.name_or_path=m", "data.train=a.jsonl", "data.streaming=true",
                           "training.per_device_batch_size=2"], notes=False)
