"""Bad input of every kind ends in one line that names the thing (issue 9 items 4 and 5).

Models: a missing path, an unreachable hub id, a truncated safetensors file, a checkpoint of another
vocabulary. Runs: an unwritable output_dir, an absurd learning rate, one line per torchrun job. Data:
a non-UTF-8 byte, a non-JSON line (skipped with data.skip_invalid), the JSON error's column, a prompt
longer than max_length, chosen == rejected, an empty file, and the per-cause count of dropped rows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from alignkit.algorithms.sft import sft_example
from alignkit.config import load_config
from alignkit.config.schema import DataConfig, ModelConfig
from alignkit.data.io import convert_rows, read_rows
from alignkit.data.pipelines import TokenData
from alignkit.data.preference import load_pairs
from alignkit.errors import ConfigError, DataError, ModelError

# the causes as the start-up log says them
PROMPT_TOO_LONG = "prompt longer than data.max_length"
TRUNCATED = "truncated to data.max_length"
SAME_PAIR = "with chosen identical to rejected (no preference to learn)"
SAME_AFTER_TRUNCATION = "with chosen identical to rejected once truncated to data.max_length (no preference to learn)"

GOOD = {"prompt": "What is 2+3?", "completion": "5"}
PAIR = {"prompt": "What is 2+3?", "chosen": "5", "rejected": "6"}


@pytest.fixture(scope="module")
def tok(micro_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(micro_model)


def write_lines(path: Path, *lines: bytes | dict) -> str:
    path.write_bytes(b"".join(x if isinstance(x, bytes) else json.dumps(x).encode() + b"\n" for x in lines))
    return str(path)


def sft(tok, max_length: int = 64):
    return lambda row: sft_example(tok, row, max_length=max_length)


# ------------------------------------------------------------------------------------------ models


def test_missing_model_path_says_so(tmp_path: Path) -> None:
    from alignkit.models.loading import load_tokenizer

    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(ModelError, match=r"no such local directory, and not a hub model id") as e:
        load_tokenizer(ModelConfig(name_or_path=missing))
    assert missing in str(e.value) and "\n" not in str(e.value)


def test_unreachable_hub_id_says_so() -> None:
    from alignkit.models.sources import translate

    e = OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")
    err = translate(e, "some-org/some-model")
    assert isinstance(err, ModelError)
    assert str(err) == ("model 'some-org/some-model': no such local directory, and no hub model that can be "
                        "reached (We couldn't connect to 'https://huggingface.co' to load the files.)")
    assert translate(RuntimeError("a bug"), "some-org/some-model") is None  # bugs keep their traceback


@pytest.fixture
def truncated_model(micro_model: Path, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(micro_model, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return d


def test_truncated_safetensors_names_the_file(truncated_model: Path, tok) -> None:
    from alignkit.models.roles import ModelSpec, build_model

    spec = ModelSpec("policy", str(truncated_model), "lm", trainable=False)
    with pytest.raises(ModelError, match=r"model\.safetensors: not a readable safetensors file .*truncated") as e:
        build_model(spec, ModelConfig(name_or_path=str(truncated_model)), torch.float32, tok)
    assert str(truncated_model / "model.safetensors") in str(e.value)


def test_truncated_checkpoint_weights_name_the_file(truncated_model: Path) -> None:
    from alignkit.models.weights import read_safetensors_dir

    with pytest.raises(ModelError, match=r"model\.safetensors: not a readable safetensors file"):
        read_safetensors_dir(truncated_model)


def _tiny_lm(vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))


def test_checkpoint_of_another_vocabulary_names_key_and_shapes(tmp_path: Path) -> None:
    from alignkit.models.weights import load_weights_into

    _tiny_lm(48).save_pretrained(tmp_path / "ckpt")
    model = _tiny_lm(32)
    before = model.model.embed_tokens.weight.clone()
    with pytest.raises(ModelError) as e:
        load_weights_into(model, tmp_path / "ckpt")
    msg = str(e.value)
    assert re.search(r": (lm_head|model\.embed_tokens)\.weight has shape \[48, 16\] in the checkpoint but \[32, 16\] "
                     r"in the model \(2 tensors differ\)", msg), msg
    assert "another vocabulary" in msg and "\n" not in msg
    assert torch.equal(model.model.embed_tokens.weight, before)  # nothing half-copied


# ------------------------------------------------------------------------------------------ runs


def test_output_dir_under_a_file_is_named(tmp_path: Path) -> None:
    from alignkit.train.runner import check_output_dir

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError) as e:
        check_output_dir(tmp_path / "afile" / "run")
    assert str(e.value) == (f"output_dir '{tmp_path / 'afile' / 'run'}': cannot write there "
                            f"({tmp_path / 'afile'} is a file, not a directory)")
    check_output_dir(tmp_path / "fine" / "run")  # created, probe removed
    assert list((tmp_path / "fine" / "run").iterdir()) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes to read-only directories")
def test_read_only_output_dir_is_named(tmp_path: Path) -> None:
    from alignkit.train.runner import check_output_dir

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"output_dir '.*ro/run': cannot write there \(Permission denied\)"):
            check_output_dir(ro / "run")
    finally:
        ro.chmod(0o700)


BASE = ["model.name_or_path=m", "data.train=builtin:sft_train.jsonl", "training.per_device_batch_size=1"]


@pytest.mark.parametrize("lr, message", [("1e38", r"must be <= 1.0, got 1e\+38"), ("2.0", "must be <= 1.0"),
                                         (".inf", "must be <= 1.0"), (".nan", "must be > 0, got nan")])
def test_absurd_learning_rate_is_a_config_error(lr: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"training.learning_rate: {message}"):
        load_config(None, [*BASE, f"training.learning_rate={lr}"])
    assert load_config(None, [*BASE, "training.learning_rate=1.0"]).training.learning_rate == 1.0


def _failing_train(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    import alignkit.cli.run_commands as runner  # the command's module: run_train and load_config as it calls them

    def fail(cfg: object) -> None:
        raise error

    monkeypatch.setattr(runner, "run_train", fail)
    monkeypatch.setattr(runner, "load_config", lambda *a, **k: object())


def test_other_ranks_leave_shared_errors_to_rank0(monkeypatch: pytest.MonkeyPatch) -> None:
    from alignkit.cli import leave_to_rank0
    from alignkit.planner.preflight import PreflightError

    shared = [ConfigError("c"), DataError("d"), ModelError("m"), FileNotFoundError("f")]
    for env, expected in (({}, False), ({"RANK": "0", "LOCAL_RANK": "0"}, False),
                          ({"RANK": "3", "LOCAL_RANK": "1"}, True), ({"RANK": "1"}, True),
                          ({"RANK": "4", "LOCAL_RANK": "0"}, False)):  # node 2's first rank speaks for its node
        for k in ("RANK", "LOCAL_RANK"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert [leave_to_rank0(e) for e in shared] == [expected] * 4, env
        assert not leave_to_rank0(PreflightError("pre-flight: rank 1 has torch 2.3"))  # belongs to its rank


def test_rank_specific_error_printed_at_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from alignkit.cli import main
    from alignkit.planner.preflight import PreflightError

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr("time.sleep", lambda s: pytest.fail("a rank-specific error must not wait"))
    _failing_train(monkeypatch, PreflightError("pre-flight: ranks differ: rank 1 torch 2.3"))
    assert main(["train", "x.yaml"]) == 2
    assert capsys.readouterr().err == "alignkit: error: pre-flight: ranks differ: rank 1 torch 2.3\n"


def test_shared_error_on_another_rank_waits_then_speaks(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 normally prints and exits first and the launcher stops this rank while it waits; a rank
    still running after the grace period (rank 0 did not fail alike) prints the line itself."""
    from alignkit import cli

    waited = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr("time.sleep", waited.append)
    _failing_train(monkeypatch, DataError("a.jsonl:3: not valid JSON"))
    assert cli.main(["train", "x.yaml"]) == 2
    assert waited == [cli.RANK0_GRACE_S]
    assert capsys.readouterr().err == "alignkit: error: (rank 1) a.jsonl:3: not valid JSON\n"


# ------------------------------------------------------------------------------------------ data


def test_non_utf8_byte_names_file_and_line(tmp_path: Path, tok) -> None:
    f = write_lines(tmp_path / "a.jsonl", GOOD, GOOD, b'{"prompt": "caf\xe9", "completion": "x"}\n', GOOD)
    with pytest.raises(DataError, match=rf"^{f}:3: not UTF-8 text \(byte 0xe9 at byte 16 of the line\)"):
        read_rows(f)
    with pytest.raises(DataError, match=rf"^{f}:3: not UTF-8"):
        convert_rows([f], sft(tok), skip_invalid=False)
    out, counts = convert_rows([f], sft(tok), skip_invalid=True)
    assert len(out) == 3 and counts.dropped == {"not UTF-8": 1} and counts.first["not UTF-8"] == f"{f}:3"


def test_skip_invalid_skips_a_non_json_line(tmp_path: Path, tok) -> None:
    f = write_lines(tmp_path / "a.jsonl", GOOD, b'{"prompt": "cut off here\n', b'["a", "list"]\n', GOOD)
    with pytest.raises(DataError, match=rf"^{f}:2: not valid JSON"):
        convert_rows([f], sft(tok), skip_invalid=False)
    out, counts = convert_rows([f], sft(tok), skip_invalid=True)
    assert len(out) == 2 and counts.dropped == {"not valid JSON": 1, "not a JSON object": 1}
    assert counts.first == {"not valid JSON": f"{f}:2", "not a JSON object": f"{f}:3"}


@pytest.mark.parametrize("line, column", [(b'{"prompt": "a", "completion": tru}\n', 31),
                                          (b'{"prompt": "a",\n', 16),  # cut off: the end of the line, not "column 1"
                                          (b'{"prompt": "a", "completion": "b"}}\r\n', 35)])
def test_json_error_reports_the_right_column(tmp_path: Path, line: bytes, column: int) -> None:
    f = write_lines(tmp_path / "a.jsonl", GOOD, line)
    with pytest.raises(DataError) as e:
        read_rows(f)
    assert str(e.value).startswith(f"{f}:2: not valid JSON: ") and str(e.value).endswith(f"(column {column})")


def test_byte_order_mark_and_crlf_are_fine(tmp_path: Path) -> None:
    f = tmp_path / "a.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n\r\n" + json.dumps(GOOD).encode() + b"\r\n")
    assert [(r.data, r.line) for r in read_rows(str(f))] == [(GOOD, 1), (GOOD, 3)]


def test_long_prompt_is_counted_under_its_own_cause(tmp_path: Path, tok) -> None:
    long_prompt = {"prompt": " ".join(["word"] * 80), "completion": "ok"}
    long_answer = {"prompt": "hi", "completion": " ".join(["word"] * 80)}
    f = write_lines(tmp_path / "a.jsonl", GOOD, long_prompt, long_answer, long_prompt, GOOD)
    out, counts = convert_rows([f], sft(tok, max_length=32), skip_invalid=False)  # dropped without skip_invalid
    assert len(out) == 3 and all(len(ex["input_ids"]) <= 32 for ex in out)
    assert counts.dropped == {PROMPT_TOO_LONG: 2} and counts.first[PROMPT_TOO_LONG] == f"{f}:2"
    assert counts.kept == {TRUNCATED: 1} and counts.first[TRUNCATED] == f"{f}:3"
    assert counts.lines("training") == [
        f"Dropped 2 training rows: 2 prompt longer than data.max_length (first: {f}:2)",
        f"1 training row truncated to data.max_length (first: {f}:3)",
    ]


def test_chosen_equal_rejected_is_kept_with_a_warning(tmp_path: Path, tok) -> None:
    same = {**PAIR, "rejected": PAIR["chosen"]}
    f = write_lines(tmp_path / "a.jsonl", PAIR, same, PAIR, same)
    examples, counts = load_pairs(tok, [f], max_length=64, pair="helpful", chat_template=False, skip_invalid=False)
    assert len(examples) == 4 and counts.total_dropped == 0
    assert counts.kept == {SAME_PAIR: 2} and counts.first[SAME_PAIR] == f"{f}:2"
    assert counts.lines("training") == [f"Warning: 2 training rows {SAME_PAIR} (first: {f}:2)"]
    # responses that differ only beyond max_length become the same tokens: said too
    long = {"prompt": "p", "chosen": "same start " * 30 + "A", "rejected": "same start " * 30 + "B"}
    _, counts = load_pairs(tok, [write_lines(tmp_path / "b.jsonl", long)], max_length=24, pair="helpful",
                           chat_template=False, skip_invalid=False)
    assert counts.kept == {TRUNCATED: 1, SAME_AFTER_TRUNCATION: 1}


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file_says_it_has_no_rows(tmp_path: Path, tok, content: bytes) -> None:
    f = tmp_path / "train.jsonl"
    f.write_bytes(content)
    with pytest.raises(DataError) as e:
        convert_rows([str(f)], sft(tok), skip_invalid=True)
    assert str(e.value) == f"{f}: the data file has no rows"


def test_no_row_left_names_the_causes(tmp_path: Path, tok) -> None:
    f = write_lines(tmp_path / "a.jsonl", b"{bad\n", {"prompt": "p"})
    with pytest.raises(DataError) as e:
        convert_rows([f], sft(tok), skip_invalid=True)
    assert str(e.value) == (f"{f}: no usable rows, 2 dropped: 1 not valid JSON (first: {f}:1), "
                            f"1 malformed (first: {f}:2: missing field 'completion' (row has ['prompt']))")


def test_row_counts_log_every_cause_with_its_first_row() -> None:
    from alignkit.data.io import RowCounts

    c = RowCounts()
    c.drop(PROMPT_TOO_LONG, "a.jsonl:17")
    c.drop("not valid JSON", "a.jsonl:40")
    c.drop(PROMPT_TOO_LONG, "a.jsonl:90")
    assert c.total_dropped == 3
    assert c.lines("training") == [("Dropped 3 training rows: 2 prompt longer than data.max_length (first: a.jsonl:17), "
                                    "1 not valid JSON (first: a.jsonl:40)")]
    assert RowCounts().lines() == []


def test_pipeline_keeps_skipped_totals_and_counts(tmp_path: Path, tok) -> None:
    f = write_lines(tmp_path / "a.jsonl", GOOD, b"{bad\n", {"prompt": " ".join(["word"] * 80), "completion": "ok"})
    data = TokenData(tok, DataConfig(max_length=32, skip_invalid=True), sft(tok, max_length=32))
    assert len(data.build_dataset([f], "train")) == 1
    assert data.skipped == {"train": 2}  # evaluate's message and `alignkit validate` read this
    assert data.row_counts["train"].dropped == {"not valid JSON": 1, PROMPT_TOO_LONG: 1}
