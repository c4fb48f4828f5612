"""The example fields of a prepared folder as memory-mapped numpy arrays, so a training process reads its
cache with numpy alone (``pyarrow`` and its compute module are ~32 MiB resident once imported).

Preparation writes, beside the Arrow files, ``columns/<field>.npy`` for a numeric or bool field and
``columns/<field>.values.npy`` + ``columns/<field>.offsets.npy`` for a list of numbers (row i is
``values[offsets[i]:offsets[i + 1]]``), and ``columns/<field>.valid.npy`` where some rows hold null
(read back as None, as Arrow gives it: e.g. a pair without safety labels); the manifest's ``columns``
names them. A field of another type (text, nested lists) is not written, and the folder is read
through Arrow as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

SUBDIR = "columns"


def write_columns(table: Any, fields: Sequence[str], folder: Path) -> dict[str, str] | None:
    """Write ``fields`` of the ``pyarrow.Table`` ``table`` under ``folder/columns``; their kinds
    (``"list"`` / ``"scalar"``), or None (nothing written) when a field has another type."""
    import pyarrow as pa

    kinds: dict[str, str] = {}
    for name in fields:
        t = table.schema.field(name).type
        if pa.types.is_list(t) and _numeric(t.value_type):
            kinds[name] = "list"
        elif _numeric(t):
            kinds[name] = "scalar"
        else:
            return None
    out = folder / SUBDIR
    out.mkdir()
    for name, kind in kinds.items():
        col = table.column(name).combine_chunks()
        if col.null_count:
            np.save(out / f"{name}.valid.npy", col.is_valid().to_numpy(zero_copy_only=False))
        if kind == "scalar":
            np.save(out / f"{name}.npy", col.fill_null(False if pa.types.is_boolean(col.type) else 0).to_numpy(
                zero_copy_only=False))
            continue
        lengths = col.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = np.zeros(len(col) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = col.flatten().to_numpy(zero_copy_only=False)  # the non-null rows' values, in order
        assert len(values) == offsets[-1], (name, len(values), offsets[-1])
        np.save(out / f"{name}.values.npy", values)
        np.save(out / f"{name}.offsets.npy", offsets)
    return kinds


def _numeric(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


class Columns:
    """Rows of one or more prepared folders' numpy columns (memory-mapped), in order: what
    :class:`~alignkit.data.examples.ExampleTable` reads when every field it needs was written."""

    def __init__(self, parts: list[dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]],
                 sizes: list[int]) -> None:
        self.parts, self.sizes = parts, sizes
        self.starts = np.cumsum([0] + sizes)

    @classmethod
    def open(cls, folder: Path, kinds: dict[str, str], rows: int) -> Columns:
        d, cols = folder / SUBDIR, {}
        for name, kind in kinds.items():
            valid = np.load(d / f"{name}.valid.npy", mmap_mode="r") if (d / f"{name}.valid.npy").is_file() else None
            if kind == "scalar":
                cols[name] = (np.load(d / f"{name}.npy", mmap_mode="r"), None, valid)
            else:
                cols[name] = (np.load(d / f"{name}.values.npy", mmap_mode="r"),
                              np.load(d / f"{name}.offsets.npy", mmap_mode="r"), valid)
        return cls([cols], [rows])

    @staticmethod
    def concat(parts: Sequence[Columns]) -> Columns:
        return Columns([c for p in parts for c in p.parts], [n for p in parts for n in p.sizes])

    @property
    def column_names(self) -> list[str]:
        return list(self.parts[0])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def select(self, names: Sequence[str]) -> Columns:
        missing = [n for n in names if n not in self.parts[0]]
        if missing:
            raise KeyError(f"no column {missing[0]!r} (have {self.column_names})")
        return Columns([{n: p[n] for n in names} for p in self.parts], self.sizes)

    def take_dict(self, rows: Sequence[int]) -> dict[str, list[Any]]:
        """``{field: [value of each row]}``: Python lists of numbers for list fields, numbers otherwise."""
        out: dict[str, list[Any]] = {n: [] for n in self.column_names}
        for r in rows:
            part = int(np.searchsorted(self.starts, r, side="right")) - 1
            i = r - int(self.starts[part])
            for name, (values, offsets, valid) in self.parts[part].items():
                if valid is not None and not valid[i]:
                    out[name].append(None)
                elif offsets is None:
                    out[name].append(values[i].item())
                else:
                    out[name].append(values[offsets[i] : offsets[i + 1]].tolist())
        return out
