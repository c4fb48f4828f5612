"""InterruptWatch without a training run: ``ranks`` (under torchrun, gloo): a SIGTERM that reaches rank 1 alone
stops every rank, and the per-step check's cost; ``twice DELAY``: a repeated signal DELAY seconds after the
first (within REPEAT_S: the same request; later: stop at once)."""

import json
import os
import signal
import sys
import time

from alignkit.train.interrupt import InterruptWatch


def ranks() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with InterruptWatch() as watch:
        before = watch.requested()
        n, start = 2000, time.perf_counter()
        for _ in range(n):
            watch.requested()
        per_call_us = (time.perf_counter() - start) / n * 1e6
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        dist.barrier()
        after = watch.requested()
    # one write of the whole line: unbuffered (PYTHONUNBUFFERED), print writes the text and its newline apart, and the
    # two ranks' lines could interleave on the shared pipe
    sys.stdout.write(json.dumps({"rank": rank, "before": before, "after": after, "per_call_us": per_call_us}) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


def twice(delay: float) -> None:
    with InterruptWatch() as watch:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        print(f"still running; requested={watch.requested()}", flush=True)


if __name__ == "__main__":
    ranks() if sys.argv[1] == "ranks" else twice(float(sys.argv[2]))
