"""Pre-flight check right after the process group starts, before any model is built.

Two failures otherwise cost a long, silent wait or a confusing crash deep inside training:

* a rank that never arrives (wrong MASTER_ADDR on one node, a firewall, a node that crashed): with
  gloo, ``monitored_barrier`` names the ranks that did not arrive within the timeout; with nccl (no
  monitored barrier) a timed all-reduce says that some rank is stuck;
* ranks that differ in torch / transformers / alignkit version, backend or resolved strategy (a stale
  virtualenv on one node, ``auto`` deciding differently on unequal machines): every rank's report is
  gathered and compared with rank 0's.

Either ends in one line naming the rank(s); :class:`PreflightError` is a user error for the CLI.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

import alignkit
from alignkit.errors import UserError

#: report fields that must be equal on every rank (host is only shown)
COMPARED = ("torch", "transformers", "alignkit", "backend", "strategy", "world_size")


class PreflightError(UserError, RuntimeError):
    """Ranks cannot train together; the message is one line naming the rank(s)."""


def local_report(backend: str, strategy: str) -> dict[str, Any]:
    """What this rank runs (tests replace this on one rank to fake a version mismatch)."""
    import torch
    import torch.distributed as dist
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "alignkit": getattr(alignkit, "__version__", "?"), "backend": backend, "strategy": strategy,
            "world_size": dist.get_world_size(), "host": socket.gethostname()}


def _reach_everyone(timeout_s: float) -> None:
    """Every rank arrives at a first collective within ``timeout_s`` and the sum comes out right."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as e:  # rank 0: "Ranks 1, 3 failed to pass monitoredBarrier in 60000 ms"
            msg = " ".join(str(e).split())
            raise PreflightError(f"pre-flight: not every rank arrived within {timeout_s:g} s "
                                 f"(distributed.preflight_timeout_s): {msg[:300]}") from None
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    ones = torch.ones(1, device=device)
    work = dist.all_reduce(ones, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise PreflightError(
                f"pre-flight: rank {dist.get_rank()}: the first all-reduce over {world} ranks did not finish "
                f"within {timeout_s:g} s (distributed.preflight_timeout_s); a rank is stuck or unreachable: "
                "check MASTER_ADDR/MASTER_PORT, --nnodes/--node-rank and the network between nodes")
        time.sleep(0.01)
    work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if int(ones.item()) != world:
        raise PreflightError(f"pre-flight: all-reduce of ones over {world} ranks gave {ones.item():g}")


def mismatches(reports: list[dict[str, Any]]) -> list[str]:
    """``rank R (host) has KEY=V, rank 0 (host) has V0`` for every field that differs from rank 0."""
    ref = reports[0]
    out = []
    for rank, rep in enumerate(reports[1:], start=1):
        for key in COMPARED:
            if rep.get(key) != ref.get(key):
                out.append(f"rank {rank} ({rep.get('host')}) has {key} {rep.get(key)}, "
                           f"rank 0 ({ref.get('host')}) has {ref.get(key)}")
    return out


def preflight(backend: str, strategy: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Run both checks on every rank (call right after the process group starts); rank 0's report."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {}
    _reach_everyone(timeout_s)
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, local_report(backend, strategy))
    bad = mismatches(reports)
    if bad:  # every rank sees the same gathered list, so every rank raises the same error
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise PreflightError("pre-flight: ranks differ: " + "; ".join(bad[:3]) + more
                             + ". Install the same versions on every node.")
    return reports[0]
