"""No large float32 matmul under bf16 autocast (ARCHITECTURE 9b), checked on real training steps on the CPU.

A ``TorchDispatchMode`` sees every aten matmul a run dispatches (forward, backward, optimizer, generation; the
ones inside autograd Functions such as the chunked LM head too) with its operands' dtypes. A bf16 run
(``model.dtype=bf16``: the Strategy's ``torch.autocast("cpu", dtype=torch.bfloat16)``) of SFT (plain and LoRA),
DPO with a frozen reference (forward each step, and precomputed), a reward model's scalar head, and PPO's
value head with its rollout must run no matmul above :data:`LARGE_MACS` with float32 operands; an fp32 run
must run none in bf16 (fp32 training keeps fp32 math).

Threshold: 2**16 = 65,536 multiply-adds. Every projection of the micro model on a micro-batch is above it (a
64 x 64 q_proj on >= 16 tokens; the LM head's 64 x ~1000 on a single token), so an fp32 layer or head shows;
what stays below is fp32 by design and costs nothing on a GPU (a scalar head's (S, H) x (H, 1) read-out
after its bf16 GEMM, rotary tables, a decode step's 4-token attention projections in a 2-layer model).
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from alignkit.config import load_config
from alignkit.ops.logprobs import chunked_token_logps
from alignkit.train.runner import run_train
from tests.conftest import REPO, write_config
from tests.integration.test_online_cli import online_config

LARGE_MACS = 1 << 16
#: matmul ops (any overload: out=, in-place) -> positions of their two operands in ``args``
MATMULS = {"mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "linear": (0, 1), "addmm": (1, 2), "addmm_": (1, 2),
           "baddbmm": (1, 2), "baddbmm_": (1, 2), "addbmm": (1, 2), "addbmm_": (1, 2)}


def macs(name: str, a: torch.Tensor, b: torch.Tensor) -> int:
    """Multiply-adds of ``a @ b`` (``linear``: ``a @ b.T``)."""
    return a.numel() * (b.shape[0] if name == "linear" else b.shape[-1])


class MatmulAudit(TorchDispatchMode):
    """Counts matmuls by operand dtype; keeps where each large float32 one was called from."""

    def __init__(self) -> None:
        super().__init__()
        self.large: Counter[torch.dtype] = Counter()
        self.large_fp32: Counter[str] = Counter()
        self.any: Counter[torch.dtype] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in MATMULS:
            a, b = (args[i] for i in MATMULS[name])
            dtype = torch.float32 if torch.float32 in (a.dtype, b.dtype) else a.dtype
            self.any[dtype] += 1
            if macs(name, a, b) > LARGE_MACS:
                self.large[dtype] += 1
                if dtype == torch.float32:
                    where = [f"{f.filename.rsplit('/src/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack()
                             if "alignkit" in f.filename][-3:]
                    self.large_fp32[f"{name} {tuple(a.shape)}x{tuple(b.shape)} at {' < '.join(where[::-1])}"] += 1
        return func(*args, **(kwargs or {}))


def audited_run(path: Path | None, overrides: list[str]) -> MatmulAudit:
    """One in-process ``alignkit train`` of the config at ``path`` (None: overrides only) under the audit."""
    cfg = load_config(path, [*overrides, "training.max_steps=1", "checkpoint.save_final=false",
                             "logging.report_to=[jsonl]", "logging.plot=false"])
    audit = MatmulAudit()
    with audit:
        run_train(cfg)
    return audit


def run_config(name: str, micro_model: Path, tmp_path: Path, dtype: str) -> tuple[Path | None, list[str]]:
    """(config file, overrides) of one audited workload on the micro model."""
    base = [f"model.name_or_path={micro_model}", f"output_dir={tmp_path / 'run'}", f"model.dtype={dtype}"]
    small = ["data.max_train_examples=8", "data.max_length=64", "data.eval=[]", "training.per_device_batch_size=4"]
    if name in ("sft", "sft_lora"):
        cfg = {"algorithm": "sft", "data": {"train": "builtin:sft_train.jsonl"}}
        lora = ["model.lora={r: 4, alpha: 8, dropout: 0.0}"] if name == "sft_lora" else []
        return write_config(tmp_path / "sft.yaml", cfg), [*base, *small, *lora]
    if name in ("dpo", "dpo_precompute"):
        return REPO / "configs" / "dpo.yaml", [*base, *small, f"dpo.precompute_ref_logps={name == 'dpo_precompute'}"]
    if name == "reward_model":
        return REPO / "configs" / "rm_helpful.yaml", [*base, *small]
    prompts = tmp_path / "prompts.jsonl"
    from alignkit.data.synth import make_prompt_rows, write_rows

    write_rows(make_prompt_rows(8, seed=0), prompts)
    cfg = online_config(micro_model, prompts, tmp_path / "run", name, rollout={"num_generations": 2})
    return write_config(tmp_path / f"{name}.yaml", cfg), [*base, "training.per_device_batch_size=4"]


WORKLOADS = ["sft", "sft_lora", "dpo", "dpo_precompute", "reward_model", "ppo"]


@pytest.mark.parametrize("name", WORKLOADS)
def test_no_large_fp32_matmul_under_bf16(name: str, micro_model: Path, tmp_path: Path) -> None:
    audit = audited_run(*run_config(name, micro_model, tmp_path, "bf16"))
    assert audit.large[torch.bfloat16] > 10, audit.any  # the run's GEMMs were seen, in bf16
    assert not audit.large_fp32, "float32 matmuls under bf16 autocast:\n" + "\n".join(
        f"{n} x {k}" for k, n in audit.large_fp32.most_common())


def test_fp32_run_keeps_fp32_math(micro_model: Path, tmp_path: Path) -> None:
    audit = audited_run(*run_config("sft", micro_model, tmp_path, "fp32"))
    assert audit.any[torch.float32] > 10 and set(audit.any) == {torch.float32}, audit.any


def test_audit_sees_an_fp32_head_inside_autograd_functions() -> None:
    """The audit itself: the chunked head's matmuls (forward, recompute and gradients run inside an autograd
    Function) are counted in bf16 under autocast, and the same op outside autocast is flagged as float32."""
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(1000, 32, requires_grad=True)  # 64 x 32 x 1000 = 2M multiply-adds per full pass
    targets = torch.randint(0, 1000, (64,))
    with MatmulAudit() as bf16, torch.autocast("cpu", dtype=torch.bfloat16):
        chunked_token_logps(hidden, weight, targets, chunk_size=16).sum().backward()
    assert bf16.large[torch.bfloat16] == 4 * 4 and not bf16.large_fp32  # 4 chunks x (fwd, recompute, dh, dW)
    with MatmulAudit() as fp32:
        chunked_token_logps(hidden, weight, targets, chunk_size=16).sum().backward()
    assert sum(fp32.large_fp32.values()) == 16 and "logprobs.py" in next(iter(fp32.large_fp32))
