"""``training.liger_kernel``: Liger-Kernel's fused linear cross-entropy as the SFT head loss.

On a CPU only the refusals can run: one ``alignkit: error:`` line before any model loads (another algorithm,
a device that is not CUDA, the package missing). On a CUDA machine with liger-kernel installed, its summed NLL
and gradients equal the built-in chunked head's, and an SFT step through it the built-in step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from alignkit.config import load_config
from alignkit.errors import ConfigError
from alignkit.models import liger
from alignkit.models.liger import check_liger, liger_installed, liger_nll_sum
from alignkit.ops.logprobs import chunked_token_logps
from tests.conftest import run_cli, write_config
from tests.integration.test_bad_input_cli import one_error_line

NEEDS_LIGER = (pytest.mark.gpu,
               pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
               pytest.mark.skipif(not liger_installed(), reason="needs liger-kernel (pip install 'alignkit[liger]')"))


def needs_liger(fn: Any) -> Any:
    for mark in NEEDS_LIGER:
        fn = mark(fn)
    return fn


def test_refusals_are_one_line() -> None:
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    with pytest.raises(ConfigError, match=r"^training.liger_kernel: .* sft loss only, not dpo; set training"):
        check_liger("dpo", cuda)
    with pytest.raises(ConfigError, match=r"^training.liger_kernel: .*needs a CUDA GPU \(this run's device is cpu\)"):
        check_liger("sft", torch.device("cpu"))


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"liger-kernel is not installed: pip install 'alignkit\[liger\]'") as e:
        check_liger("sft", torch.device("cuda", 0))
    assert "\n" not in str(e.value)


def test_cli_refuses_on_cpu_before_any_model_loads(sft_config: dict[str, Any], tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal needs a machine without CUDA")
    sft_config["training"]["liger_kernel"] = True
    proc = run_cli(["train", str(write_config(tmp_path / "sft.yaml", sft_config))])
    assert "training.liger_kernel: Liger-Kernel is Triton and needs a CUDA GPU" in one_error_line(proc)
    assert "Policy model:" not in proc.stdout + proc.stderr  # refused before the model loaded


@needs_liger
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", ["fp32", "bf16"])
def test_liger_equals_the_chunked_head(lead: str, bias: bool) -> None:
    """Summed NLL, grad hidden and grad weight: Liger's kernel against the built-in chunked path, fp32 master
    weights, in fp32 and under bf16 autocast (both cast to bf16 before their GEMMs)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 300, 64, 1000
    base = [torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / h**0.5,
            torch.randn(v, generator=g) if bias else None]
    targets = torch.randint(0, v, (n,), generator=g).cuda()
    results = []
    for fn in (lambda x, w, b: liger_nll_sum(x, w, targets, bias=b),
               lambda x, w, b: -chunked_token_logps(x, w, targets, bias=b, chunk_size=128).sum()):
        leaves = [t.cuda().requires_grad_() if t is not None else None for t in base]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=lead == "bf16"):
            loss = fn(*leaves)
        loss.backward()
        results.append([loss.detach(), *(t.grad for t in leaves if t is not None)])
    tol = dict(rtol=2e-2, atol=2e-2) if lead == "bf16" else dict(rtol=1e-4, atol=1e-4)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **tol)


@needs_liger
def test_sft_step_through_liger_matches_builtin(sft_config: dict[str, Any], tmp_path: Path) -> None:
    from alignkit.train.runner import run_train

    losses = []
    for on in (False, True):
        cfg = dict(sft_config, output_dir=str(tmp_path / f"run-{on}"))
        cfg["training"] = dict(cfg["training"], liger_kernel=on, max_steps=2)
        cfg["model"] = dict(cfg["model"], dtype="bf16")
        run_train(load_config(write_config(tmp_path / f"sft-{on}.yaml", cfg)))
        rows = [json.loads(x) for x in (tmp_path / f"run-{on}" / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows if "loss" in r])
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=2e-2)
