"""``alignkit ARGS`` with each optimizer step slowed by SECONDS (``python slow_steps.py SECONDS ARGS...``, alone or
under torchrun): a signal sent "mid-run" lands mid-run on a model whose steps take milliseconds. Only the pace
changes: the sleep runs before the step, outside its math."""

import sys
import time

from alignkit.train.offline_loop import OfflineTrainer
from alignkit.train.online_loop import OnlineTrainer

pause = float(sys.argv[1])


def slowed(step):  # type: ignore[no-untyped-def]
    def slow_step(self, group):  # type: ignore[no-untyped-def]
        time.sleep(pause)
        return step(self, group)
    return slow_step


OfflineTrainer._step = slowed(OfflineTrainer._step)
OnlineTrainer._step = slowed(OnlineTrainer._step)

from alignkit.cli import main

sys.exit(main(sys.argv[2:]))
