"""Bad input of every kind ends in one line that names the thing (issue 9 item 4).

Models: a missing path, an unreachable hub id, a truncated safetensors file, a checkpoint of another
vocabulary. Runs: an unwritable output_dir, an absurd learning rate, one line per torchrun job.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from alignkit.config import load_config
from alignkit.config.schema import ModelConfig
from alignkit.errors import ConfigError, DataError, ModelError


@pytest.fixture(scope="module")
def tok(micro_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(micro_model)


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
    from alignkit.train import runner

    def fail(cfg: object) -> None:
        raise error

    monkeypatch.setattr(runner, "run_train", fail)
    monkeypatch.setattr("alignkit.config.load_config", lambda *a, **k: object())


def test_other_ranks_leave_shared_errors_to_rank0(monkeypatch: pytest.MonkeyPatch) -> None:
    from alignkit.cli import leave_to_rank0
    from alignkit.distributed.preflight import PreflightError

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
    from alignkit.distributed.preflight import PreflightError

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
