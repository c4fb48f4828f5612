"""User errors are one line and exit 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignkit.cli import main
from alignkit.errors import ConfigError, DataError, ModelError, UnknownNameError, UserError


@pytest.mark.parametrize("error", [ConfigError("training.learning_rate: must be > 0, got -1"),
                                   DataError("a.jsonl:3: field 'prompt' is missing"),
                                   ModelError("m is not a reward/cost model"),
                                   UnknownNameError("unknown algorithm 'dpp' (did you mean 'dpo'?)"),
                                   FileNotFoundError("x.yaml does not exist")])
def test_user_errors_are_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                  error: Exception) -> None:
    import alignkit.cli.run_commands as runner  # the command's module: run_train and load_config as it calls them

    def fail(cfg: object) -> None:
        raise error

    monkeypatch.setattr(runner, "run_train", fail)
    monkeypatch.setattr(runner, "load_config", lambda *a, **k: object())
    assert main(["train", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == f"alignkit: error: {error}\n" and "\n" not in str(error)
    assert isinstance(error, UserError) or isinstance(error, FileNotFoundError)


@pytest.mark.parametrize("bug", [ValueError("shape mismatch"), KeyError("seq_index"), RuntimeError("boom")])
def test_internal_errors_keep_their_traceback(monkeypatch: pytest.MonkeyPatch, bug: Exception) -> None:
    import alignkit.cli.run_commands as runner  # the command's module: run_train and load_config as it calls them

    def fail(cfg: object) -> None:
        raise bug

    monkeypatch.setattr(runner, "run_train", fail)
    monkeypatch.setattr(runner, "load_config", lambda *a, **k: object())
    with pytest.raises(type(bug)):
        main(["train", "x.yaml"])


def test_unknown_registry_name_reads_as_a_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("algorithm: ddpo\nmodel: {name_or_path: m}\ndata: {train: a.jsonl}\n"
                   "training: {per_device_batch_size: 1}\n")
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("alignkit: error: algorithm: unknown 'ddpo' (did you mean 'dpo'?)") and err.count("\n") == 1
