"""Examples read from a memory-mapped Arrow table by index, and the per-example values computed later.

:class:`ExampleTable` is what a prepared data set gives the loop: ``len``, ``table[i]`` (a dict of
Python values), ``table.__getitems__(indices)`` (a micro-batch at once, which ``DataLoader`` uses),
and ``subset``. Rows stay in the Arrow files (the operating system pages them in and out), so a
rank's memory does not grow with the data set: what it holds is the index of kept rows
(8 bytes a row, itself memory-mapped when it comes from the cache) and the side table.

Arrow rows are immutable, so values computed after preparation (DPO's cached reference log-probs)
live in a side table keyed by the base row (``set_fields``): one numpy array per field, shared by a
table and every ``subset`` of it, so a value set through a subset is seen through the whole table.
:func:`set_fields` and :func:`subset` also accept plain lists of dicts (pipelines that build
lists keep working).
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np


class ExampleTable:
    """``len`` examples: ``rows`` (:class:`~alignkit.data.columns.Columns` or a ``pyarrow.Table``, both
    memory-mapped) at base positions ``index``
    (all rows in order when None), with fields of ``columns`` only, plus side-table fields; ``files``: the
    Arrow files the rows are mapped from (for messages and tests)."""

    def __init__(self, rows: Any, index: np.ndarray | None = None, *, columns: Sequence[str] | None = None,
                 extras: dict[str, tuple[np.ndarray, np.ndarray]] | None = None, files: Sequence[str] = ()) -> None:
        self.rows = rows if columns is None else rows.select(list(columns))
        self.files = list(files)
        self.index = index
        #: field -> (values, present) over base rows; shared with subsets
        self.extras = {} if extras is None else extras

    def __len__(self) -> int:
        return len(self.rows) if self.index is None else len(self.index)

    def base(self, i: int) -> int:
        """The base row of example ``i``."""
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} out of range ({len(self)} examples)")
        return i if self.index is None else int(self.index[i])

    def __getitem__(self, i: int | slice) -> Any:
        """Example ``i`` as a dict; a slice gives a list of them (as a list of examples would)."""
        if isinstance(i, slice):
            return self.__getitems__(range(*i.indices(len(self))))
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        base = [self.base(int(i)) for i in indices]
        if hasattr(self.rows, "take_dict"):  # numpy columns (alignkit.data.columns)
            cols = self.rows.take_dict(base)
        else:
            cols = self.rows.take(base).to_pydict()  # one Arrow take for the whole micro-batch
        names = list(cols)
        out = [{k: cols[k][j] for k in names} for j in range(len(base))]
        for name, (values, present) in self.extras.items():
            for ex, b in zip(out, base):
                if present[b]:
                    ex[name] = values[b].item()
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, len(self), 256):
            yield from self.__getitems__(range(start, min(start + 256, len(self))))

    def subset(self, positions: Sequence[int] | np.ndarray) -> ExampleTable:
        """Examples ``positions`` of this table (same rows, same side table)."""
        pos = np.asarray(positions, dtype=np.int64)
        index = pos if self.index is None else np.asarray(self.index)[pos]
        return ExampleTable(self.rows, index, extras=self.extras, files=self.files)

    def set_fields(self, i: int, **values: Any) -> None:
        """Attach ``values`` to example ``i`` (seen by every table sharing this side table)."""
        b = self.base(i)
        n = len(self.rows)
        for name, value in values.items():
            if name not in self.extras:
                self.extras[name] = (np.zeros(n, dtype=np.asarray(value).dtype), np.zeros(n, dtype=bool))
            arr, present = self.extras[name]
            arr[b], present[b] = value, True


def set_fields(examples: Any, i: int, **values: Any) -> None:
    """Attach ``values`` to example ``i`` of a table or of a list of dicts."""
    if isinstance(examples, ExampleTable):
        examples.set_fields(i, **values)
    else:
        examples[i].update(values)


def subset(examples: Any, positions: Sequence[int]) -> Any:
    """Examples ``positions`` of a table (a view sharing its side table) or of a list (the same dicts)."""
    if isinstance(examples, ExampleTable):
        return examples.subset(positions)
    return [examples[int(i)] for i in positions]
