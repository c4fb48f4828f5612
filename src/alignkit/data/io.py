"""Reading row files (.jsonl, .json, .parquet, builtin:NAME) with errors that name file and line, and
the count of rows dropped or changed on the way to examples, by cause (:class:`RowCounts`)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from alignkit.constants import BUILTIN_PREFIX
from alignkit.errors import DataError
from alignkit.progress import Progress
from alignkit.resources import resource_path


@dataclass
class Row:
    data: dict[str, Any]
    source: str  # file path
    line: int  # 1-based line (jsonl) or row number (parquet/json)
    #: what the conversion did to a row it kept (e.g. TRUNCATED), and whether each deserves a warning
    notes: list[tuple[str, bool]] = field(default_factory=list)
    #: why the conversion returned None for this row (it is dropped), e.g. PROMPT_TOO_LONG
    dropped: str | None = None

    def where(self, field: str | None = None) -> str:
        loc = f"{self.source}:{self.line}"
        return f"{loc} field {field!r}" if field else loc

    def note(self, cause: str, *, warn: bool = False) -> None:
        """Record that the row is kept but changed or suspicious (counted by cause in the start-up log)."""
        if cause not in (c for c, _ in self.notes):
            self.notes.append((cause, warn))

    def drop(self, cause: str) -> None:
        """Record why the row yields no example (the converter then returns None)."""
        self.dropped = cause


#: causes of dropped or changed rows that several converters share (the start-up log counts each)
TRUNCATED = "truncated to data.max_length"
PROMPT_TOO_LONG = "prompt longer than data.max_length"
NOTHING_TO_LEARN = "no tokens to learn from"


@dataclass
class RowCounts:
    """Rows of one split that did not become examples unchanged, by cause: ``dropped`` (not in the data
    set: skipped as malformed with ``data.skip_invalid``, or nothing left to learn) and ``kept`` (in it,
    but changed or suspicious, e.g. truncated); the first row of each cause (``file:line``, and the
    error for a malformed row) says where to look."""

    dropped: Counter[str] = field(default_factory=Counter)
    kept: Counter[str] = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)
    warn: set[str] = field(default_factory=set)

    def drop(self, cause: str, where: str) -> None:
        self.dropped[cause] += 1
        self.first.setdefault(cause, where)

    def keep(self, cause: str, where: str, *, warn: bool = False) -> None:
        self.kept[cause] += 1
        self.first.setdefault(cause, where)
        if warn:
            self.warn.add(cause)

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())

    def summary(self) -> str:
        """The dropped rows by cause, most frequent first: ``2 not valid JSON (first: a.jsonl:4: ...), ...``."""
        return ", ".join(f"{n} {c} (first: {self.first[c]})" for c, n in self.dropped.most_common())

    def lines(self, split: str = "training") -> list[str]:
        """The start-up log: one line for the dropped rows (every cause), one line per cause of kept
        rows (``Warning:`` for the suspicious ones)."""
        out = []
        if self.dropped:
            out.append(f"Dropped {_rows(self.total_dropped, split)}: {self.summary()}")
        for c, n in self.kept.most_common():
            out.append(f"{'Warning: ' if c in self.warn else ''}{_rows(n, split)} {c} (first: {self.first[c]})")
        return out


def _rows(n: int, split: str) -> str:
    return f"{n} {split} row{'' if n == 1 else 's'}"


def resolve_path(spec: str) -> Path:
    """A path on disk, or a data set shipped inside the package (``builtin:sft_train.jsonl``)."""
    if spec.startswith(BUILTIN_PREFIX):
        return resource_path(spec)
    p = Path(spec).expanduser()
    if not p.exists():
        raise DataError(f"data file {spec!r} does not exist")
    return p


def parse_jsonl_line(raw: bytes, path: Path, i: int) -> dict[str, Any]:
    """One line of a .jsonl file (bytes, newline included) -> its object; a DataError naming
    ``path:i`` and the cause otherwise."""
    where = f"{path}:{i}"
    text = raw.rstrip(b"\r\n")
    if i == 1 and text.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (some Windows editors)
        text = text[3:]
    try:
        line = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{text[e.start]:02x} at byte {e.start + 1} of the line); "
                        "save the file as UTF-8", cause="not UTF-8") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON: {e.msg} (column {e.colno})", cause="not valid JSON") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {type(obj).__name__}",
                        cause="not a JSON object")
    return obj


def read_json_list(path: Path) -> list[dict[str, Any]]:
    """The objects of a .json data file (a list of objects); not UTF-8, not JSON or another shape is a
    DataError naming the file (and line)."""
    data = path.read_bytes()
    try:
        obj = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the file as UTF-8",
                        cause="not UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})",
                        cause="not valid JSON") from None
    if not isinstance(obj, list) or not all(isinstance(o, dict) for o in obj):
        raise DataError(f"{path}: a .json data file must hold a list of objects")
    return obj


def read_rows(spec: str, *, on_bad: Callable[[DataError, str], None] | None = None) -> list[Row]:
    """Every row of a data file. A .jsonl line that cannot be read (not UTF-8, not JSON, not an object)
    raises a DataError naming file:line, or with ``on_bad`` is passed to it (with its file:line) and skipped."""
    path = resolve_path(spec)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with path.open("rb") as fh:  # bytes: split on \n alone (JSON allows \r in between tokens), decode per line
            for i, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    rows.append(Row(parse_jsonl_line(raw, path, i), str(path), i))
                except DataError as e:
                    if on_bad is None:
                        raise
                    on_bad(e, f"{path}:{i}")
        return rows
    if suffix == ".json":
        return [Row(o, str(path), i) for i, o in enumerate(read_json_list(path), start=1)]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return [Row(o, str(path), i) for i, o in enumerate(table.to_pylist(), start=1)]
    raise DataError(f"{path}: unsupported data file type {suffix!r}; use .jsonl, .json or .parquet")


def convert_rows(
    specs: list[str],
    convert: Callable[[Row], Any],
    *,
    skip_invalid: bool,
    limit: int | None = None,
    read: Callable[..., list[Row]] | None = None,
) -> tuple[list[Any], RowCounts]:
    """Apply ``convert`` to every row of every file; returns (examples, what happened to the others).

    ``convert`` raises :class:`DataError` for a malformed row; with ``skip_invalid`` the row (like a
    line that is not UTF-8 or not JSON) is skipped and counted under the error's cause, otherwise the
    error (naming file, line, field) propagates. ``convert`` returns None for a row it drops (cause:
    ``row.drop(...)``, else NOTHING_TO_LEARN) and may ``row.note(...)`` changes to a row it keeps. A
    file without rows, or files of which no row is left, are a DataError. ``read(spec, on_bad=...)`` reads
    a spec's rows (default :func:`read_rows`: files).
    """
    out: list[Any] = []
    counts = RowCounts()

    def skip(e: DataError, where: str) -> None:
        # a vague cause ("malformed": a missing or mistyped field) shows the first error itself
        counts.drop(e.cause, str(e) if e.cause == "malformed" else where)

    for spec in specs:
        bad_lines = counts.total_dropped
        rows = (read or read_rows)(spec, on_bad=skip if skip_invalid else None)
        if not rows and counts.total_dropped == bad_lines:
            raise DataError(f"{spec}: the data file has no rows", cause="empty file")
        with Progress(len(rows) if limit is None else min(limit, len(rows)), f"preparing {spec}", "rows") as bar:
            for row in rows:
                if limit is not None and len(out) >= limit:
                    return out, counts
                bar.update()
                try:
                    ex = convert(row)
                except DataError as e:
                    if not skip_invalid:
                        raise
                    skip(e, row.where())
                    continue
                if ex is None:
                    counts.drop(row.dropped or NOTHING_TO_LEARN, row.where())
                    continue
                for cause, warn in row.notes:
                    counts.keep(cause, row.where(), warn=warn)
                out.append(ex)
    if not out:
        raise DataError(f"{', '.join(specs)}: no usable rows, {counts.total_dropped} dropped: {counts.summary()}")
    return out, counts


def require_field(row: Row, field: str) -> Any:
    """The row's ``field``; a DataError naming the file, line and the fields the row has if missing."""
    if field not in row.data:
        raise DataError(f"{row.where()}: missing field {field!r} (row has {sorted(row.data)})")
    return row.data[field]


def require_str(row: Row, field: str) -> str:
    value = require_field(row, field)
    if not isinstance(value, str):
        raise DataError(f"{row.where(field)}: expected a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{row.where(field)}: is empty")
    return value


def require_messages(row: Row, field: str, value: Any = None) -> list[dict[str, str]]:
    """A chat: a non-empty list of {role, content} with role in system/user/assistant."""
    value = row.data.get(field) if value is None else value
    if not isinstance(value, list) or not value:
        raise DataError(f"{row.where(field)}: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{row.where(field)}[{i}]: expected an object with 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise DataError(f"{row.where(field)}[{i}]: unknown role {m['role']!r} (system, user, assistant, tool)")
        if not isinstance(m["content"], str):
            raise DataError(f"{row.where(field)}[{i}].content: expected a string, got {type(m['content']).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    return out
