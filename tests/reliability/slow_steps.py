"""``alignkit ARGS`` with each optimizer step slowed by SECONDS (``python slow_steps.py SECONDS ARGS...``, alone or
under torchrun): a signal sent "mid-run" lands mid-run on a model whose steps take milliseconds. Only the pace
changes: the sleep runs before the step, outside its math."""

import signal
import sys
import time

# Ctrl-C at a terminal reaches a foreground process whose SIGINT is Python's default handler. A test run started in
# the background of a non-interactive shell (bash sets background jobs' SIGINT to ignored, and children inherit it)
# would hand this worker an ignored SIGINT, deaf to the test's Ctrl-C where checkpoint.save_on_interrupt=false
# leaves Python's handling in place: restore what a terminal's process has.
signal.signal(signal.SIGINT, signal.default_int_handler)

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
