"""The LM head + token log-prob loss alone, forward and backward: alignkit's chunked head (chunks by memory, and
the former fixed 1024 rows), Liger-Kernel's fused linear cross-entropy where it is installed (CUDA), and the
plain full-logits path (``F.linear`` + ``cross_entropy``) for reference. Each variant reports ms per fwd+bwd,
its summed loss (the variants must agree) and its peak memory above the inputs (CUDA).

Default shape: the issue-38 workload's head (Qwen2.5-0.5B: hidden 896, vocab 151,936; ~9k loss tokens per
step), fp32 master weights under bf16 autocast as training runs it. On a CPU use a smaller shape:

    python benchmarks/bench_lm_head.py                          # GPU, the Qwen2.5-0.5B head
    python benchmarks/bench_lm_head.py --device cpu --tokens 2048 --vocab 8192 --hidden 256 --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

from alignkit.models.liger import liger_installed, liger_nll_sum
from alignkit.ops.logprobs import chunk_rows, chunked_token_logps

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def variants(device: torch.device, vocab: int) -> dict[str, Loss]:
    """name -> summed NLL of (hidden, weight, targets)."""
    auto = chunk_rows(vocab, device)
    out: dict[str, Loss] = {
        f"chunked, by memory ({auto} rows)": lambda h, w, t: -chunked_token_logps(h, w, t).sum(),
        "chunked, 1024 rows (before)": lambda h, w, t: -chunked_token_logps(h, w, t, chunk_size=1024).sum(),
        "full logits (F.linear + cross_entropy)": lambda h, w, t: F.cross_entropy(
            F.linear(h, w).float(), t, reduction="sum"),
    }
    if device.type == "cuda" and liger_installed():
        out["liger fused linear cross-entropy"] = lambda h, w, t: liger_nll_sum(h, w, t)
    return out


def measure(fn: Loss, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, autocast: bool,
            warmup: int, iters: int) -> dict[str, float]:
    """ms per forward + backward (mean of ``iters`` after ``warmup``), the summed loss of a first untimed step,
    and, on CUDA, the peak memory above the inputs' in MiB."""
    device = hidden.device
    cuda = device.type == "cuda"

    def step() -> float:
        hidden.grad = weight.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(hidden, weight, targets)
        loss.backward()
        return loss.detach()

    first = float(step())  # the variants must agree before their times mean anything

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if cuda:
        torch.cuda.synchronize()
    result = {"ms": (time.perf_counter() - start) / iters * 1e3, "loss": first}
    if cuda:
        result["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return result


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=9216, help="loss tokens per step")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16 = fp32 weights under autocast")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(a.tokens, a.hidden, device=device, generator=g).requires_grad_()
    weight = (torch.randn(a.vocab, a.hidden, device=device, generator=g) / a.hidden**0.5).requires_grad_()
    targets = torch.randint(0, a.vocab, (a.tokens,), device=device, generator=g)
    rows = []
    for name, fn in variants(device, a.vocab).items():
        r = measure(fn, hidden, weight, targets, autocast=a.dtype == "bf16", warmup=a.warmup, iters=a.iters)
        rows.append({"variant": name, **r})
        print(f"{name:45s} {r['ms']:9.2f} ms  loss {r['loss']:.6g}" + (f"  peak +{r['peak_extra_mib']:.0f} MiB" if "peak_extra_mib" in r else ""))
    print(json.dumps({"device": str(device), "tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab,
                      "dtype": a.dtype, "torch": torch.__version__, "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
