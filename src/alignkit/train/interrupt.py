"""Ctrl-C and SIGTERM (a scheduler's preemption) during training: stop at a step boundary with a checkpoint.

``checkpoint.save_on_interrupt`` (default true): the first SIGINT or SIGTERM only sets a flag; the loop asks
:meth:`InterruptWatch.requested` at the end of each optimizer step (offline) or iteration (online), saves a
checkpoint at that step and raises :class:`Interrupted`, which the CLI turns into one line and exit status
128 + the signal (130 SIGINT, 143 SIGTERM). Nothing is saved from inside the handler: a handler runs between
two bytecodes of whatever the main thread was doing (the middle of a backward, of a collective).

Ranks must stop at the same step, but a signal may reach only some of them (or reach them a few
milliseconds apart, on either side of a step's end): the flags are summed over ranks on the host
(``comm.all_reduce_host_sum``: gloo, never the accelerator; a few tens of microseconds, once per step) so
every rank takes the same decision. Each rank calls it once per check, which every rank makes alike.

A second signal stops at once: the handler puts the signal's default action back and sends the signal
again, so the process ends as killed by it (no checkpoint; an unfinished one stays a hidden ``.tmp-``
folder the next run removes). A second signal that comes within ``REPEAT_S`` of the first counts as the same
one: torchrun forwards a SIGINT or SIGTERM to workers that the terminal or Slurm already signalled.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from alignkit.distributed import comm
from alignkit.errors import Interrupted

if TYPE_CHECKING:
    from alignkit.logging import RunLogger
    from alignkit.train.step import Checkpointer, TrainState

#: the signals that ask for a stop at the next step's end
SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: seconds within which a repeated signal is the same request (a launcher forwarding what its workers got)
REPEAT_S = 2.0


class InterruptWatch:
    """Catches SIGINT / SIGTERM while the training loop runs (a context manager; handlers are put back on
    exit). Disabled (``enabled=False``, or off the main thread, where Python cannot set handlers) it never
    asks for a stop and the signals keep their usual effect."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None  # the first signal this process got
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> InterruptWatch:
        if self.enabled:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            return
        if now - self._first_at < REPEAT_S:
            return  # the same request, forwarded (torchrun) or sent to the whole process group
        sys.stderr.write(f"alignkit: {signal.Signals(signum).name} again: stopping at once, without a checkpoint\n")
        sys.stderr.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def requested(self) -> int | None:
        """The signal to stop for, the same on every rank (SIGTERM over SIGINT when ranks got both), or None.
        A collective over ranks: every rank calls it at the same points, also when disabled."""
        mine = [float(self.signum == signal.SIGINT), float(self.signum == signal.SIGTERM)]
        interrupts, terms = comm.all_reduce_host_sum(mine) if self.enabled else (0.0, 0.0)
        if terms:
            return int(signal.SIGTERM)
        return int(signal.SIGINT) if interrupts else None


def stop_if_requested(watch: InterruptWatch, state: TrainState, checkpointer: Checkpointer,
                      save: Callable[[TrainState], Path], log: RunLogger) -> None:
    """At a step's end: when a signal asked for a stop (on any rank), save a checkpoint at ``state.step``
    (``save(state)``; none when the run wrote one at this step already) and raise :class:`Interrupted`."""
    signum = watch.requested()
    if signum is None:
        return
    log.info(f"{signal.Signals(signum).name} received: saving a checkpoint at step {state.step} and stopping")
    done = checkpointer.saved
    path = done[1] if done is not None and done[0] == state.step else save(state)
    log.close()
    raise Interrupted(signum, state.step, path)


def note_late_signal(watch: InterruptWatch, log: RunLogger) -> None:
    """After the run's end (last checkpoint, pruning, final model), all under the watch: a signal that came
    during it (no step is left to stop at) is one line; the run has finished whole and ends as a finished run."""
    if watch.signum is not None:
        log.info(f"{signal.Signals(watch.signum).name} received while the run was finishing: it finished first "
                 "(last checkpoint and final model saved, as configured)")
