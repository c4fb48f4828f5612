"""The examples of ``data.train`` / ``data.eval``: every source prepared once (rank 0 prepares, the other
ranks wait and memory-map the same folder), then joined in order, cut at ``max_*_examples``, and
drawn by weight when the sources form a mixture.

Under a launcher, rank 0 prepares (or finds) each source's folder and sends its path to the others
(``comm.broadcast_object``, which is also their wait). A rank that cannot see that folder is on
another node without a shared file system: the first rank of each such node prepares its own copy,
the others of that node wait (``comm.barrier``) and read it. The log says which case held.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from alignkit.data.cache import Job, Prepared, counts_from_json, default_cache_root, open_prepared, prepare, row_counts
from alignkit.data.columns import Columns
from alignkit.data.examples import ExampleTable
from alignkit.data.io import RowCounts
from alignkit.data.sources import Source, resolve_source
from alignkit.distributed import comm
from alignkit.distributed.env import read_env
from alignkit.errors import DataError, UserError

log = logging.getLogger("alignkit")


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else default_cache_root()


def shared_prepare(src: Source, job: Job, root: Path) -> Path:
    """The prepared folder of ``src`` on this rank (module docstring); a user error on rank 0 is
    raised on every rank."""
    if comm.world_size() == 1:
        return prepare(src, job, root)
    status: tuple[Any, ...] = ()
    if comm.rank() == 0:
        try:
            status = ("ok", str(prepare(src, job, root)))
        except UserError as e:
            status = ("error", type(e), str(e), getattr(e, "cause", "malformed"))
    status = comm.broadcast_object(status)
    if status[0] == "error":
        cls, message, cause = status[1:]
        raise cls(message, cause=cause) if issubclass(cls, DataError) else cls(message)
    folder = Path(status[1])
    env = read_env()
    seen = comm.all_gather_object(((folder / "manifest.json").is_file(), socket.gethostname()))
    nodes = {host for _, host in seen}
    if all(ok for ok, _ in seen):
        where = "one node" if len(nodes) == 1 else f"{len(nodes)} nodes through a shared file system"
        log.info(f"Data cache: {src.name} prepared by rank 0, memory-mapped by {len(seen)} ranks on {where}")
        return folder
    # another node cannot see rank 0's folder: its first rank prepares a copy, the others read it
    here = (folder / "manifest.json").is_file()
    if not here and env.local_rank == 0:
        folder = prepare(src, job, root)
    comm.barrier()
    if not here and env.local_rank != 0:
        folder = prepare(src, job, root)  # finds the copy its node's first rank made
    log.info(f"Data cache: {src.name} prepared once per node ({len(nodes)} nodes; the cache folder "
             f"{root} is not shared between them)")
    return folder


def merge_counts(into: RowCounts, other: RowCounts) -> None:
    into.dropped.update(other.dropped)
    into.kept.update(other.kept)
    for cause, where in other.first.items():
        into.first.setdefault(cause, where)
    into.warn |= other.warn


def load_examples(specs: Sequence[str], job: Job, *, root: Path, skip_invalid: bool, limit: int | None = None,
                  split: str | None = None, config: str | None = None,
                  weights: Sequence[float] | None = None, seed: int = 0) -> tuple[ExampleTable, RowCounts]:
    """The examples of ``specs`` in order (the first ``limit`` kept ones), and what happened to the
    other rows; with ``weights``, a mixture drawn from them (:func:`mixture_index`)."""
    counts = RowCounts()
    parts: list[tuple[Prepared, np.ndarray]] = []
    remaining = limit
    for spec in specs:
        if remaining == 0:
            break
        src = resolve_source(spec, split=split, config=config)
        p = open_prepared(shared_prepare(src, job, root))
        keep, cutoff = p.keep, None
        if remaining is not None:
            if len(keep) >= remaining:
                keep = keep[:remaining]
                cutoff = int(keep[-1]) + 1 if len(keep) else p.manifest["rows"]
            remaining -= len(keep)
        first = p.manifest["first_error"]
        if not skip_invalid and first is not None and (cutoff is None or first["position"] < cutoff):
            raise DataError(first["message"], cause=first["cause"])
        merge_counts(counts, counts_from_json(p.manifest["counts"]) if cutoff is None
                     else row_counts(p.table, p.manifest["source"], cutoff))
        parts.append((p, keep))
    if sum(len(k) for _, k in parts) == 0:
        raise DataError(f"{', '.join(specs)}: no usable rows, {counts.total_dropped} dropped: {counts.summary()}")
    fields = parts[0][0].manifest["fields"]
    if len(parts) == 1 and not weights:
        p, keep = parts[0]
        index = None if len(keep) == p.manifest["rows"] else keep
        return ExampleTable(p.rows, index, columns=fields, files=p.files), counts
    offsets = np.cumsum([0] + [p.manifest["rows"] for p, _ in parts])
    rows = concat_rows([p for p, _ in parts], fields)
    keeps = [np.asarray(k, dtype=np.int64) + off for (_, k), off in zip(parts, offsets)]
    if weights:
        names = [p.manifest["source"] for p, _ in parts]
        index = mixture_index(keeps, list(weights)[: len(keeps)], seed=seed, names=names)
    else:
        index = np.concatenate(keeps)
    return ExampleTable(rows, index, columns=fields, files=[f for p, _ in parts for f in p.files]), counts


def concat_rows(parts: list[Prepared], fields: list[str]) -> Any:
    """The ``fields`` of several prepared sources' rows in order: numpy columns when every source has them,
    else their Arrow tables (memory-mapped, not copied)."""
    rows = [p.rows for p in parts]
    if all(isinstance(r, Columns) for r in rows):
        return Columns.concat([r.select(fields) for r in rows])
    import pyarrow as pa

    return pa.concat_tables([p.table.select(fields) for p in parts])


def mixture_index(keeps: list[np.ndarray], weights: list[float], *, seed: int, names: list[str]) -> np.ndarray:
    """A mixture of the sources' examples, as many as all sources hold together (N), source i
    giving ``round(N * w_i / sum(w))``: whole passes over its examples, then a seeded random part of
    one more pass (no example twice within a part). The training order shuffles the result."""
    total = sum(len(k) for k in keeps)
    share = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    want = np.floor(share * total + 0.5).astype(np.int64)
    rng = np.random.default_rng(seed)
    out, said = [], []
    for keep, n, w, name in zip(keeps, want, share, names):
        passes, rest = divmod(int(n), len(keep))
        out.append(np.tile(keep, passes))
        out.append(np.sort(rng.choice(keep, size=rest, replace=False)) if rest else keep[:0])
        said.append(f"{name} {int(n)} examples (weight {w:.2f}, {n / len(keep):.2f} x its {len(keep)})")
    log.info("Data mixture: " + "; ".join(said))
    return np.concatenate(out)
