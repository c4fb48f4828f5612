"""benchmarks/bench_vlm.py: TRL's marked chat template renders what the tiny LLaVA's renders, the LLaVA rows
become TRL's messages without the placeholder, and the table reports medians and token mismatches (the
benchmark itself is not run here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType
from typing import Any

import jinja2
import pytest

from alignkit.models.tiny_vlm import VLM_CHAT_TEMPLATE
from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_vlm.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_vlm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _render(template: str, messages: list[dict[str, Any]]) -> str:
    return jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=False)


def test_the_marked_template_is_the_models_template_plus_generation_markers(bench: ModuleType) -> None:
    marked = bench.MARKED_TEMPLATE
    assert marked.count("{% generation %}") == marked.count("{% endgeneration %}") == 1
    plain = marked.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    chats = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the circle?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
         {"role": "user", "content": [{"type": "text", "text": "How many shapes are there?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "2"}]}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>\nhi"},
         {"role": "assistant", "content": "ok"}],
    ]
    for chat in chats:
        assert _render(plain, chat) == _render(VLM_CHAT_TEMPLATE, chat)
    # the marked span holds the assistant content and its end of turn, the tokens alignkit's mask covers
    start = marked.index("{% generation %}")
    assert "<|im_end|>\n{% endgeneration %}" in marked[start:]


def test_llava_rows_become_messages_without_the_placeholder(bench: ModuleType) -> None:
    row = {"id": "x", "image": "images/x.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour is the circle?"}, {"from": "gpt", "value": "red"},
        {"from": "human", "value": "Where is the circle?"}, {"from": "gpt", "value": "top left"}]}
    (got,) = bench.trl_rows([row])
    assert got["image"] == "images/x.png"
    assert got["messages"] == [{"role": "user", "content": "What colour is the circle?"},
                               {"role": "assistant", "content": "red"},
                               {"role": "user", "content": "Where is the circle?"},
                               {"role": "assistant", "content": "top left"}]


def _run(tok_s: float, rss: float, tokens: int = 1000, loss_tokens: int = 100) -> dict[str, Any]:
    return {"ok": True, "tok_s": tok_s, "s_step": tokens / tok_s, "peak_rss_mib": rss, "tokens": tokens,
            "loss_tokens": loss_tokens, "trainable_params": 5}


def _meta() -> dict[str, Any]:
    return {"when": "now", "cpu": "cpu", "warmup": 1, "timed": 3, "alignkit_commit": "abc", "loadavg_start": 0.1,
            "loadavg_end": 0.2, "quick": True, "trl_version": "1.16.0"}


def test_the_table_gives_medians_ratios_and_spread(bench: ModuleType) -> None:
    runs = {"alignkit": [_run(3000, 600), _run(2000, 610), _run(2800, 620)],
            "trl": [_run(1000, 1000), _run(1500, 1200), _run(1400, 1100)]}
    table = bench.render(runs, _meta())
    assert "| alignkit | 3 | 2800 (2000-3000) |" in table
    assert "| trl | 3 | 1400 (1000-1500) |" in table
    assert "**2.00x tok/s**" in table and "**0.55x peak RSS**" in table
    assert "per alternating pair 3.00, 1.33, 2.00" in table
    assert "agree on both sides" in table


def test_the_table_flags_different_token_counts(bench: ModuleType) -> None:
    runs = {"alignkit": [_run(3000, 600)], "trl": [_run(1000, 1000, loss_tokens=90)]}
    assert "**Token counts differ between runs**" in bench.render(runs, _meta())


def test_the_script_parses_its_arguments() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--runs" in proc.stdout
