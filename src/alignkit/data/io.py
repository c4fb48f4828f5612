"""Reading row files (.jsonl, .json, .parquet, builtin:NAME) with errors that name file and line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from alignkit.constants import BUILTIN_PREFIX
from alignkit.errors import DataError


@dataclass
class Row:
    data: dict[str, Any]
    source: str  # file path
    line: int  # 1-based line (jsonl) or row number (parquet/json)

    def where(self, field: str | None = None) -> str:
        loc = f"{self.source}:{self.line}"
        return f"{loc} field {field!r}" if field else loc


def resolve_path(spec: str) -> Path:
    """A path on disk, or a data set shipped inside the package (``builtin:sft_train.jsonl``)."""
    if spec.startswith(BUILTIN_PREFIX):
        from alignkit.resources import resource_path

        return resource_path(spec)
    p = Path(spec).expanduser()
    if not p.exists():
        raise DataError(f"data file {spec!r} does not exist")
    return p


def read_rows(spec: str) -> list[Row]:
    path = resolve_path(spec)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as fh:
            for i, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{path}:{i}: expected a JSON object per line, got {type(obj).__name__}")
                rows.append(Row(obj, str(path), i))
        return rows
    if suffix == ".json":
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, list) or not all(isinstance(o, dict) for o in obj):
            raise DataError(f"{path}: a .json data file must hold a list of objects")
        return [Row(o, str(path), i) for i, o in enumerate(obj, start=1)]
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
) -> tuple[list[Any], int]:
    """Apply ``convert`` to every row of every file; returns (examples, number skipped).

    ``convert`` raises :class:`DataError` for a malformed row; with ``skip_invalid`` the row is
    skipped and counted, otherwise the error (naming file, line, field) propagates.
    """
    from alignkit.progress import Progress

    out: list[Any] = []
    skipped = 0
    for spec in specs:
        rows = read_rows(spec)
        with Progress(len(rows) if limit is None else min(limit, len(rows)), f"preparing {spec}", "rows") as bar:
            for row in rows:
                if limit is not None and len(out) >= limit:
                    return out, skipped
                bar.update()
                try:
                    ex = convert(row)
                except DataError:
                    if not skip_invalid:
                        raise
                    skipped += 1
                    continue
                if ex is None:
                    skipped += 1
                    continue
                out.append(ex)
    return out, skipped


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
