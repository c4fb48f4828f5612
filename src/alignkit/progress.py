"""Progress of every phase that can take more than a few seconds (training, reference precompute,
evaluation, generation, data preparation), shown by rank 0 only.

On a terminal (``logging.progress_bar: auto``) a tqdm bar; elsewhere (a log file, CI) a line every
``LINE_EVERY_S`` seconds with the count, rate and ETA, e.g.
``precompute reference log-probs: 640/2000 (32%), 35.2/s, ETA 39s``, and one line at the end. The
runner configures it once per run (:func:`configure`); library code just wraps its loop.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Iterable, Iterator, TypeVar

T = TypeVar("T")
log = logging.getLogger("alignkit")

#: seconds between two progress lines when no terminal shows a bar
LINE_EVERY_S = 30.0
#: a phase shorter than this prints no line at its end
QUIET_BELOW_S = 2.0

_state = {"is_main": True, "mode": "auto"}


def configure(*, is_main: bool, mode: str = "auto") -> None:
    """``mode``: ``auto`` (a bar on a terminal, lines elsewhere), ``on`` (always a bar), ``off`` (no bar,
    no lines)."""
    _state["is_main"], _state["mode"] = is_main, mode


def use_bar() -> bool:
    mode = _state["mode"]
    return mode == "on" or (mode == "auto" and sys.stderr.isatty())


def make_bar(total: int, desc: str, unit: str, initial: int = 0) -> Any:
    """A tqdm bar on stderr. A pseudo-terminal that reports a 0 x 0 size (``script``, some CI runners
    and IDE consoles) makes tqdm hide the bar (it counts 0 rows), so the size falls back to 100 x 24."""
    from tqdm import tqdm

    try:  # the terminal's own size: COLUMNS / LINES in the environment do not stop tqdm asking the terminal
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):
        size = os.terminal_size((0, 0))
    known = size.columns > 0 and size.lines > 0
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=known,
                ncols=None if known else 100, nrows=None if known else 24)


class Progress:
    """Counts work done in one phase; a bar or periodic lines on rank 0, nothing elsewhere."""

    def __init__(self, total: int, desc: str, unit: str = "it") -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.done = 0
        self.start = self.last_line = time.perf_counter()
        on = _state["is_main"] and _state["mode"] != "off"
        self.bar = make_bar(total, desc, unit) if on and use_bar() else None
        self.lines = on and self.bar is None

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.lines and time.perf_counter() - self.last_line >= LINE_EVERY_S:
            self.last_line = time.perf_counter()
            log.info(self.line())

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = self.done / elapsed
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = f", ETA {(self.total - self.done) / rate:.0f}s" if rate > 0 and self.total > self.done else ""
        return f"{self.desc}: {self.done}/{self.total}{pct}, {rate:.1f} {self.unit}/s{eta}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.lines and time.perf_counter() - self.start >= QUIET_BELOW_S:
            log.info(f"{self.desc}: {self.done}/{self.total} done in {time.perf_counter() - self.start:.1f}s")
        self.lines = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def track(items: Iterable[T], total: int, desc: str, unit: str = "it") -> Iterator[T]:
    """``items`` with progress shown (one unit per item)."""
    with Progress(total, desc, unit) as p:
        for item in items:
            yield item
            p.update()
