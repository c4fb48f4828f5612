"""`alignkit train` on bad input: one line ``alignkit: error: ...`` naming the thing, exit 2, no traceback
(issue 9 items 4 and 5); rows dropped or changed are counted by cause in the start-up log; under
torchrun the line is printed once."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import assert_ok, run_cli, write_config

GOOD = [{"prompt": f"What is {i}+1?", "completion": f"{i + 1}"} for i in range(8)]


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The single ``alignkit: error:`` line of a run that must end with exit status 2 and no traceback."""
    lines = [x for x in proc.stderr.splitlines() if x.startswith("alignkit: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, (
        f"exit {proc.returncode}\nSTDERR:\n{proc.stderr[-4000:]}")
    return lines[0]


def jsonl(path: Path, *lines: bytes | dict) -> str:
    path.write_bytes(b"".join(x if isinstance(x, bytes) else json.dumps(x).encode() + b"\n" for x in lines))
    return str(path)


def train(cfg: dict[str, Any], tmp_path: Path, **over: Any) -> subprocess.CompletedProcess[str]:
    cfg = json.loads(json.dumps(cfg))
    cfg["training"]["max_steps"] = 1
    cfg["logging"]["plot"] = False
    for dotted, value in over.items():
        *parents, leaf = dotted.split("__")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return run_cli(["train", str(write_config(tmp_path / "c.yaml", cfg))])


def truncated_copy(model: Path, tmp_path: Path) -> str:
    d = tmp_path / "model"
    shutil.copytree(model, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return str(d)


def file_in_the_way(tmp_path: Path) -> str:
    (tmp_path / "afile").write_text("x")
    return str(tmp_path / "afile" / "run")


#: name -> (the config change, given micro_model and tmp_path; what the line must say)
MODEL_AND_RUN: dict[str, tuple[Callable[[Path, Path], dict[str, Any]], str]] = {
    "missing model path": (lambda m, t: {"model__name_or_path": str(t / "no" / "model")},
                           r"model '.*/no/model': no such local directory, and not a hub model id"),
    "truncated safetensors": (lambda m, t: {"model__name_or_path": truncated_copy(m, t)},
                              r"/model/model\.safetensors: not a readable safetensors file \(.*\); it is truncated"),
    "unwritable output_dir": (lambda m, t: {"output_dir": file_in_the_way(t)},
                              r"output_dir '.*/afile/run': cannot write there \(.*/afile is a file, not a directory\)"),
    "learning_rate 1e38": (lambda m, t: {"training__learning_rate": 1e38},
                           r"training\.learning_rate: must be <= 1\.0, got 1e\+38"),
}


@pytest.mark.parametrize("case", list(MODEL_AND_RUN))
def test_bad_model_or_run_setting_is_one_line(case: str, sft_config: dict, micro_model: Path, tmp_path: Path) -> None:
    change, expected = MODEL_AND_RUN[case]
    line = one_error_line(train(sft_config, tmp_path, **change(micro_model, tmp_path)))
    assert re.search(expected, line), line


def test_checkpoint_of_another_vocabulary_is_one_line(sft_config: dict, micro_model: Path, tmp_path: Path) -> None:
    """The model directory was rebuilt with another tokenizer (512 -> 1024 tokens) between a run and its
    resume: the same config, other weight shapes."""
    from alignkit.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", size="micro", vocab_size=512)
    over = {"model__name_or_path": str(model), "output_dir": str(tmp_path / "run"), "checkpoint__save_steps": 1}
    assert_ok(train(sft_config, tmp_path, **over))
    shutil.rmtree(model)
    shutil.copytree(micro_model, model)
    ckpt = tmp_path / "run" / "checkpoint-1"
    line = one_error_line(train(sft_config, tmp_path, **over, checkpoint__resume_from=str(ckpt), training__max_steps=2))
    assert re.search(r"checkpoint-1/policy: (lm_head|model\.embed_tokens)\.weight has shape \[512, 64\] in the "
                     r"checkpoint but \[1024, 64\] in the model", line), line


def test_bad_data_is_one_line_naming_file_and_line(sft_config: dict, tmp_path: Path) -> None:
    cases = {
        "non-UTF-8": (jsonl(tmp_path / "u.jsonl", *GOOD[:2], b'{"prompt": "caf\xe9", "completion": "x"}\n'),
                      r"u\.jsonl:3: not UTF-8 text \(byte 0xe9 at byte 16 of the line\)"),
        "cut-off JSON": (jsonl(tmp_path / "j.jsonl", GOOD[0], b'{"prompt": "a",\n'),
                         r"j\.jsonl:2: not valid JSON: .* \(column 16\)$"),
        "empty file": (jsonl(tmp_path / "e.jsonl"), r"e\.jsonl: the data file has no rows$"),
    }
    for name, (path, expected) in cases.items():
        line = one_error_line(train(sft_config, tmp_path, data__train=path))
        assert re.search(expected, line), (name, line)


def test_dropped_and_truncated_rows_are_counted_by_cause(sft_config: dict, tmp_path: Path) -> None:
    long_prompt = {"prompt": " ".join(["word"] * 120), "completion": "ok"}
    long_answer = {"prompt": "hi", "completion": " ".join(["word"] * 120)}
    f = jsonl(tmp_path / "a.jsonl", *GOOD[:4], long_prompt, b"{not json\n", b'{"text": "\xff"}\n', long_answer,
              long_prompt, *GOOD[4:])
    proc = train(sft_config, tmp_path, data__train=f, data__skip_invalid=True, data__max_length=48)
    assert_ok(proc)
    assert (f"Dropped 4 training rows: 2 prompt longer than data.max_length (first: {f}:5), "
            f"1 not valid JSON (first: {f}:6), 1 not UTF-8 (first: {f}:7)") in proc.stderr
    assert f"1 training row truncated to data.max_length (first: {f}:8)" in proc.stderr
    assert "invalid or empty" not in proc.stderr


def test_torchrun_prints_the_error_once(sft_config: dict, tmp_path: Path) -> None:
    """Both ranks read the same bad file; rank 0 says so, rank 1 stays quiet (torchrun stops it) and
    torchrun's summary names rank 0's exit status 2 as the root cause."""
    f = jsonl(tmp_path / "a.jsonl", *GOOD[:4], b"{not json\n")
    cfg = json.loads(json.dumps(sft_config))
    cfg["data"]["train"] = f
    cfg["training"].update(max_steps=1, per_device_batch_size=2)
    proc = run_cli(["train", str(write_config(tmp_path / "c.yaml", cfg))], nproc=2)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("alignkit: error:")]
    assert lines == [(f"alignkit: error: {f}:5: not valid JSON: Expecting property name enclosed in double quotes "
                      "(column 2)")], proc.stderr[-4000:]
    assert proc.returncode != 0
    root = proc.stderr.partition("Root Cause")[2]
    assert re.search(r"rank +: 0 ", root) and re.search(r"exitcode +: 2 ", root), proc.stderr[-3000:]
