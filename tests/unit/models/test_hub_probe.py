"""A hub model id while the Hub cannot be reached: one line within seconds (huggingface_hub alone retries every
file for about a minute, a dozen "Retrying in Ns" lines), naming HF_HUB_OFFLINE=1; a model the cache holds
loads from there; a local folder never asks the Hub."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from alignkit.config.schema import ModelConfig
from alignkit.errors import ModelError
from alignkit.models import sources
from alignkit.models.loading import load_tokenizer
from tests.conftest import child_env, free_port, run_cli

#: the probe itself (tests below replace the module's name with stand-ins), to clear its per-process answer
PROBE = sources.hub_unreachable


@pytest.fixture
def closed_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """The Hub endpoint set to a localhost port nothing listens on, an empty cache, offline mode off."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # restored after the test (check_hub may set it)
    PROBE.cache_clear()
    yield endpoint
    PROBE.cache_clear()


def test_unreachable_hub_is_one_line_at_once(closed_hub: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ModelError) as info:
        load_tokenizer(ModelConfig(name_or_path="some-org/some-model"))
    assert time.perf_counter() - start < 5
    line = str(info.value)
    assert "\n" not in line and f"the Hub ({closed_hub}) cannot be reached" in line and "HF_HUB_OFFLINE=1" in line
    assert "'some-org/some-model'" in line


def test_cached_model_loads_from_the_cache_while_the_hub_is_down(closed_hub: str, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "hub" / "models--some-org--some-model" / "snapshots" / "abc123").mkdir(parents=True)
    logger = logging.getLogger("alignkit")
    logger.addHandler(caplog.handler)  # the CLI's console handler does not propagate
    try:
        sources.check_hub("some-org/some-model")
    finally:
        logger.removeHandler(caplog.handler)
    assert constants.HF_HUB_OFFLINE  # the loaders read the cache without retrying the Hub
    assert any("loads from the local cache" in r.getMessage() for r in caplog.records)


def test_offline_mode_without_the_model_in_the_cache(closed_hub: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(sources, "hub_unreachable", lambda endpoint: pytest.fail("offline: the Hub is not asked"))
    with pytest.raises(ModelError, match=r"not in the Hugging Face cache .* offline mode is on \(HF_HUB_OFFLINE\)"):
        sources.check_hub("some-org/some-model")


def test_a_local_folder_never_asks_the_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sources, "hub_unreachable", lambda endpoint: pytest.fail("a local path asked the Hub"))
    sources.check_hub(str(tmp_path))
    sources.check_hub("not a hub id!")  # what translate() words when loading fails


def test_validate_of_a_hub_id_without_network_fails_fast(tmp_path: Path) -> None:
    """``alignkit validate`` in a fresh interpreter with HF_ENDPOINT at a closed port: one error line, no
    retries, in seconds (was 23 lines and about 60 s)."""
    cfg = Path(__file__).parents[3] / "configs" / "sft.yaml"
    env = child_env(HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_HUB_OFFLINE", None)
    start = time.perf_counter()
    proc = run_cli(["validate", str(cfg), "model.name_or_path=Qwen/Qwen2.5-0.5B"], env=env, fresh=True, timeout=120)
    took = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Retrying" not in proc.stderr, proc.stderr
    assert "cannot be reached" in proc.stderr and "HF_HUB_OFFLINE=1" in proc.stderr
    assert took < 35, took  # the interpreter's imports included; the retries alone took about 60 s


def test_a_config_check_on_a_model_path_not_made_yet_does_not_wait_on_the_hub(closed_hub: str) -> None:
    """``is_vision_language`` (asked by config checks such as kto's, before any model exists) on a recipe's
    ``runs/tiny-model`` that was not built yet: it looks like a hub id, and huggingface_hub retried it for 25-35 s;
    now the probe answers "not a VLM" at once."""
    from alignkit.models.vlm import is_vlm_source

    start = time.perf_counter()
    assert is_vlm_source("runs/not-built-yet") is False
    assert time.perf_counter() - start < 5
