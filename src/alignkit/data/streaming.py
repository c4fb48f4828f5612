"""``data.streaming``: the training rows read as a stream, converted as they come, sharded across ranks,
with a position that a checkpoint saves and a resume restores exactly.

The rows of all sources form one sequence in file order (row ``g`` counting across files); rank r of
W owns the rows with ``g % W == r`` and converts only those (the others are skipped unparsed). Each
micro-batch is the rank's next ``per_device`` kept examples; at the end of the last source the
stream starts over (the next epoch). There is no shuffling: write the file in the order to train.

The position of a rank is (epoch, source, byte offset or row number in it, line, g): a resume seeks
there, without reading what came before. Positions are per rank, so a stream resumes at the world
size it was saved with (another one is a ConfigError naming both). Evaluation data is not streamed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO, Callable, Sequence

from alignkit.data.io import Row, RowCounts, parse_jsonl_line
from alignkit.data.sources import Source, _raw_rows, open_typed, resolve_source
from alignkit.errors import ConfigError, DataError


@dataclass
class StreamPosition:
    epoch: int = 0
    source: int = 0  # index into the sources
    offset: int = 0  # byte offset (.jsonl) or row number (other sources) of the next row in the source
    line: int = 1  # line number of that row in its file (for file:line messages)
    row: int = 0  # g: rows before it, over all sources of the epoch (which rank owns it)


class RowStream:
    """Rank ``rank`` of ``world``'s share of the rows of ``specs`` as examples (module docstring)."""

    def __init__(self, specs: Sequence[str], convert: Callable[[Row], dict[str, Any] | None], *, rank: int,
                 world: int, skip_invalid: bool, split: str | None = None, config: str | None = None) -> None:
        self.sources = [resolve_source(s, split=split, config=config) for s in specs]
        self.convert, self.rank, self.world, self.skip_invalid = convert, rank, world, skip_invalid
        self.pos = StreamPosition()
        self.counts = RowCounts()
        self._fh: BinaryIO | None = None
        self._rows: Any = None  # the open typed source (or the list of a .json file)
        self._kept_this_epoch = 0

    # ------------------------------------------------------------------ position
    def state(self) -> dict[str, int]:
        return asdict(self.pos)

    def restore(self, saved: list[dict[str, int]] | None) -> None:
        """Continue from the positions a checkpoint saved (one per rank)."""
        if saved is None:
            return
        if len(saved) != self.world:
            raise ConfigError(f"data.streaming: the checkpoint's stream positions are for {len(saved)} ranks, this run "
                              f"has {self.world}; resume a streamed run at the world size it was saved with")
        self.close()
        self.pos = StreamPosition(**saved[self.rank])
        self._kept_this_epoch = int(self.pos.row > 0)  # rows before the resume point were read by the run

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._fh, self._rows = None, None

    # ------------------------------------------------------------------ reading
    def next_examples(self, n: int) -> list[dict[str, Any]]:
        """This rank's next ``n`` examples (the position moves past them)."""
        out: list[dict[str, Any]] = []
        while len(out) < n:
            ex = self._next_example()
            if ex is not None:
                out.append(ex)
        return out

    def _next_example(self) -> dict[str, Any] | None:
        got = self._next_row()
        if got is None:  # the epoch is over
            if self._kept_this_epoch == 0:
                raise DataError(f"{', '.join(s.spec for s in self.sources)}: rank {self.rank} of {self.world} got no "
                                f"usable rows in a whole pass: {self.counts.summary() or 'no rows'}")
            self.close()
            self.pos = StreamPosition(epoch=self.pos.epoch + 1)
            self._kept_this_epoch = 0
            return None
        src, line, read = got
        try:
            row = Row(read(), src.name, line)
            ex = self.convert(row)
        except DataError as e:
            if not self.skip_invalid:
                e.same_on_every_rank = False  # only the rank that owns the row sees it
                raise
            self.counts.drop(e.cause, str(e) if e.cause == "malformed" else f"{src.name}:{line}")
            return None
        if ex is None:
            self.counts.drop(row.dropped or "no tokens to learn from", row.where())
            return None
        self._kept_this_epoch += 1
        return ex

    def _next_row(self) -> tuple[Source, int, Callable[[], dict[str, Any]]] | None:
        """The next row this rank owns: (source, line, a function parsing it); None at the epoch's end."""
        while self.pos.source < len(self.sources):
            src = self.sources[self.pos.source]
            got = self._next_in(src)
            if got is None:
                self.close()
                self.pos = StreamPosition(self.pos.epoch, self.pos.source + 1, 0, 1, self.pos.row)
                continue
            line, read = got
            g = self.pos.row
            self.pos.row += 1
            if g % self.world == self.rank:
                return src, line, read
        return None

    def _next_in(self, src: Source) -> tuple[int, Callable[[], dict[str, Any]]] | None:
        """The next row of ``src`` at the position (advanced past it), or None at the source's end."""
        if src.kind == "jsonl":
            if self._fh is None:
                self._fh = open(src.path, "rb")  # noqa: SIM115 - kept open across calls, closed by close()
                self._fh.seek(self.pos.offset)
            while True:
                raw = self._fh.readline()
                if not raw:
                    return None
                line = self.pos.line
                self.pos.offset += len(raw)
                self.pos.line += 1
                if raw.strip():
                    return line, lambda raw=raw, line=line: parse_jsonl_line(raw, src.path, line)  # type: ignore[misc]
        if self._rows is None:
            self._rows = open_typed(src) if src.typed else _json_rows(src)
        i = self.pos.offset
        if i >= len(self._rows):
            return None
        self.pos.offset += 1
        self.pos.line = i + 2
        return i + 1, lambda: dict(self._rows[i])


def _json_rows(src: Source) -> list[dict[str, Any]]:
    assert src.path is not None
    return [json.loads(raw) for _, raw in _raw_rows(src.path, "json")]
