"""Running a launch plan: print it, start the launcher, stand by it until it ends, and end as its workers did.

* The launcher (torchrun, ...) runs as a child with a parent-death signal (``parent_death.py``), and its workers
  arm one too (``LAUNCHED_ENV``): a SIGKILL to ``alignkit launch``'s process group takes every worker with it.
  SIGTERM and SIGHUP to ``alignkit launch`` are passed on to the launcher (which stops its workers); Ctrl-C reaches
  the launcher from the terminal directly (it shares the process group), so it is not sent twice.
* The launcher's stderr (and its workers', which inherit it) passes through as it comes (through a pseudo-terminal
  when stderr is a terminal, so the workers still draw progress bars), until a worker's one-line error
  (``alignkit: error: ...``): that line is shown once, and what follows (the launcher stopping the other ranks:
  SIGTERM notices, a ``ChildFailedError`` traceback, a block per rank) is held back. The run then ends with that
  worker's exit status (2 for a config or data error), not the launcher's 1. ``ALIGNKIT_DEBUG=1`` shows it all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

from alignkit.launch.parent_death import LAUNCHED_ENV, preexec
from alignkit.launch.torchrun import LaunchPlan

#: how alignkit's one-line user error starts (cli/__init__.py)
ERROR_MARK = b"alignkit: error: "
#: what is held back after a worker's error at the most (its end: torchrun's summary comes last)
HELD_BYTES = 1 << 20
#: torchrun's summary of the first failure: ``exitcode  : 2``
_ROOT_CAUSE = re.compile(rb"Root Cause.*?exitcode\s*:\s*(-?\d+)", re.DOTALL)


def run_launch(plan: LaunchPlan, *, dry_run: bool = False) -> int:
    """Print the command; unless ``dry_run``, run exactly it and return the run's exit status."""
    for note in plan.notes:
        print(f"alignkit launch: {note}", file=sys.stderr)
    if dry_run:
        print(plan.shell())
        return 0
    print(f"alignkit launch: {plan.shell()}", file=sys.stderr, flush=True)
    env = {**os.environ, **plan.env, LAUNCHED_ENV: "1"}
    if os.name != "posix":
        return subprocess.call(plan.argv, env=env)
    sys.stdout.flush()
    return supervise(plan.argv, env, filter_errors=not os.environ.get("ALIGNKIT_DEBUG"))


class FirstError:
    """Passes a stream on as it comes until the first ``ERROR_MARK`` line; holds back what follows it."""

    def __init__(self, write) -> None:
        self.write, self.pending, self.held = write, b"", bytearray()
        self.line: str | None = None

    def feed(self, chunk: bytes) -> None:
        if self.line is not None:
            self.held += chunk
            del self.held[:-HELD_BYTES]
            return
        data, self.pending = self.pending + chunk, b""
        at = data.find(ERROR_MARK)
        if at < 0:  # keep back a tail that may be the mark's start, pass on the rest (a progress bar's \r too)
            keep = next((k for k in range(len(ERROR_MARK) - 1, 0, -1) if data.endswith(ERROR_MARK[:k])), 0)
            self.write(data[:len(data) - keep])
            self.pending = data[len(data) - keep:]
            return
        end = data.find(b"\n", at)
        if end < 0:  # the line is not whole yet
            self.write(data[:at])
            self.pending = data[at:]
            return
        self.write(data[:end + 1])
        self.line = data[at:end].decode(errors="replace").rstrip("\r")
        self.held += data[end + 1:]

    def exit_status(self, launcher_status: int) -> int:
        """The run's status: the failing worker's after its one line (torchrun's root cause, else 2), else the
        launcher's, with anything held back passed on."""
        if self.line is None or launcher_status == 0:
            self.write(self.pending + bytes(self.held))
            return launcher_status
        m = _ROOT_CAUSE.search(bytes(self.held))
        return int(m.group(1)) if m and int(m.group(1)) > 0 else 2


def _stderr_channel() -> tuple[int, int]:
    """(read end, write end) for the launcher's stderr: a pseudo-terminal of this terminal's size when stderr is a
    terminal (bars stay bars; no \\n -> \\r\\n translation), else a pipe."""
    if not sys.stderr.isatty():
        return os.pipe()
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()
    with contextlib.suppress(OSError):
        fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(sys.stderr.fileno(), termios.TIOCGWINSZ, b"\0" * 8))
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.ONLCR
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    return master, slave


@contextlib.contextmanager
def _passing_signals(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """SIGTERM / SIGHUP to this process go to the launcher; Ctrl-C (SIGINT) reaches it from the terminal."""
    forward = lambda sig, _frame: proc.send_signal(sig)
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP)}
    old[signal.SIGINT] = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _write_stderr(data: bytes) -> None:
    if not data:
        return
    if (binary := getattr(sys.stderr, "buffer", None)) is not None:
        binary.write(data)
        binary.flush()
    else:  # a text-only stream (a test's capture)
        sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()


def supervise(argv: list[str], env: dict[str, str], *, filter_errors: bool = True) -> int:
    """Run ``argv`` (the launcher) as a child that dies with this process; its stderr through :class:`FirstError`."""
    if not filter_errors:
        proc = subprocess.Popen(argv, env=env, preexec_fn=preexec())  # noqa: PLW1509 (no threads here)
        with _passing_signals(proc):
            return proc.wait()
    sys.stderr.flush()
    read_end, write_end = _stderr_channel()
    proc = subprocess.Popen(argv, env=env, stderr=write_end, preexec_fn=preexec())  # noqa: PLW1509 (no threads here)
    os.close(write_end)
    first = FirstError(_write_stderr)
    with _passing_signals(proc):
        while True:
            try:
                chunk = os.read(read_end, 65536)
            except OSError as e:  # a pseudo-terminal reads EIO once every writer has closed it
                if e.errno != errno.EIO:
                    raise
                chunk = b""
            if not chunk:
                break
            first.feed(chunk)
        status = proc.wait()
    os.close(read_end)
    return first.exit_status(status if status >= 0 else 128 - status)
