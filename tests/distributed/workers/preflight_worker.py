"""Pre-flight check under 2 gloo ranks: (1) rank 1 reports a different transformers version,
(2) rank 1 arrives 4 s late with a 1.5 s timeout. Each rank prints one line per case."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from alignkit.planner import preflight as pf

dist.init_process_group("gloo")
rank = dist.get_rank()


def say(text: str) -> None:
    os.write(1, f"rank{rank} {text}\n".encode())  # one write per line: the two ranks share the pipe


real_report = pf.local_report
if rank == 1:  # a stale virtualenv on one node
    pf.local_report = lambda backend, strategy: {**real_report(backend, strategy), "transformers": "0.0.0-fake"}
try:
    pf.preflight("gloo", "ddp", timeout_s=30)
    say("MISMATCH none")
except pf.PreflightError as e:
    say(f"MISMATCH {e}")
pf.local_report = real_report

if rank == 1:
    time.sleep(4)  # stuck: rank 0 waits 1.5 s for it
try:
    pf.preflight("gloo", "ddp", timeout_s=1.5)
    say("STUCK none")
except pf.PreflightError as e:
    say(f"STUCK {e}")
if rank == 0:
    time.sleep(1)  # let the late rank finish its failed barrier before the store goes away
os._exit(0)
