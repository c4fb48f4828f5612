"""Tokenise once: one source's rows -> examples in Arrow files under a key of everything they depend on.

The key hashes the source's content identity (path, size, modification time of each file; the Arrow
files of a folder or Hub set), the tokenizer (its vocabulary and rules, special tokens, chat
template), ``data.max_length`` and the pipeline's row format (``fmt``: the algorithm's conversion and
its options). A prepared source is a folder ``<cache>/<name>-<key>/``:

* ``data*.arrow``: one row per source row, the example's fields (null where the row was dropped) and
  the bookkeeping columns ``_line``, ``_drop`` (cause), ``_error`` (the row's DataError), ``_notes``;
* ``keep.npy``: positions of the kept rows (memory-mapped at load);
* ``columns/``: the example fields again as numpy arrays (:mod:`alignkit.data.columns`), which is what a
  run reads (memory-mapped): no ``pyarrow`` in the training process;
* ``manifest.json``: files, counts, the first malformed row, the key's fields. Written last: a folder
  is complete when it has one. Preparation writes into a temporary folder renamed into place, so two
  processes preparing the same key at once never see half a folder.

The per-row checks (and their ``file:line`` errors) run inside ``datasets.map`` (``data.num_proc``
processes); every DataError is recorded on its row, and raised (the first in row order) when the set
is loaded without ``data.skip_invalid``, so the cache serves both settings.

Only preparation uses ``datasets``, and it runs in a forked child process where the platform can fork:
``datasets`` (~66 MiB resident once imported) and the map's buffers leave with the child, so a
training process never holds them. Reading a prepared folder needs numpy alone (``columns/``; the Arrow
files, memory-mapped through ``pyarrow``, only for row counts cut at ``max_*_examples`` and for fields
of other types), so a run whose cache is warm imports neither ``datasets`` nor ``pyarrow``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from alignkit import progress
from alignkit.data.columns import Columns, write_columns
from alignkit.data.io import Row, RowCounts
from alignkit.data.sources import Source, fingerprint, open_typed, parse_raw, write_raw_rows
from alignkit.errors import DataError, UserError

log = logging.getLogger("alignkit")

#: bump when the layout of a prepared folder or the meaning of its columns changes
FORMAT_VERSION = 1
BOOKKEEPING = ("_line", "_drop", "_error", "_notes")


def default_cache_root() -> Path:
    """``$ALIGNKIT_DATA_CACHE``, else ``$XDG_CACHE_HOME/alignkit/data`` (``~/.cache/alignkit/data``)."""
    env = os.environ.get("ALIGNKIT_DATA_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "alignkit" / "data"


@dataclass(frozen=True)
class Job:
    """How a pipeline turns rows into examples: ``convert(row)`` (None = dropped, DataError =
    malformed), the example ``features`` (``{field: type}`` with types such as ``"int32[]"`` (a list),
    ``"float64"``, ``"bool"``, or a ``datasets.Features``; None = inferred), and ``fmt``, a string naming
    the conversion and its options (part of the key)."""

    convert: Callable[[Row], dict[str, Any] | None]
    fmt: str
    features: Any
    tokenizer: Any
    max_length: int
    num_proc: int = 1


def tokenizer_fingerprint(tok: Any) -> str:
    """Hash of what tokenisation depends on: vocabulary and rules (cached on the object, they do not
    change), special tokens and the chat template (read each time: a template can be swapped)."""
    heavy = getattr(tok, "_alignkit_vocab_hash", None)
    if heavy is None:
        backend = getattr(tok, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
        heavy = hashlib.sha256(f"{type(tok).__name__}\n{text}".encode()).hexdigest()
        try:
            tok._alignkit_vocab_hash = heavy
        except AttributeError:
            pass
    light = json.dumps({"template": getattr(tok, "chat_template", None), "special": tok.special_tokens_map,
                        "ids": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]}, sort_keys=True, default=str)
    return hashlib.sha256(f"{heavy}\n{light}".encode()).hexdigest()


def cache_key(src: Source, job: Job, typed: Any = None) -> tuple[str, dict[str, Any]]:
    fields = {"version": FORMAT_VERSION, "source": fingerprint(src, typed), "split": src.split,
              "tokenizer": tokenizer_fingerprint(job.tokenizer), "max_length": job.max_length, "fmt": job.fmt}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20], fields


def cache_dir_for(root: Path, src: Source, key: str) -> Path:
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(src.name).name)[-60:]
    return root / f"{stem}-{key}"


def _convert_batch(batch: dict[str, list[Any]], indices: list[int] | None = None, *, job: Job, name: str,
                   kind: str, fields: list[str]) -> dict[str, list[Any]]:
    """``datasets.map`` body: each source row -> the example's fields plus the bookkeeping columns."""
    out: dict[str, list[Any]] = {k: [] for k in (*fields, *BOOKKEEPING)}
    n = len(next(iter(batch.values())))
    for j in range(n):
        if indices is not None:  # a typed source: the row itself, numbered from 1
            line, drop, error, notes = indices[j] + 1, None, None, []
            data: dict[str, Any] | None = {k: v[j] for k, v in batch.items()}
        else:
            line, drop, error, notes, data = batch["line"][j], None, None, [], None
        ex = None
        try:
            if data is None:
                data = parse_raw(name, kind, line, batch["raw"][j])
            row = Row(data, name, line)
            ex = job.convert(row)
            if ex is None:
                drop = row.dropped or "no tokens to learn from"
            notes = [f"{c}\t{int(w)}" for c, w in row.notes] if ex is not None else []
        except DataError as e:
            drop, error = e.cause, str(e)
        for k in fields:
            out[k].append(None if ex is None else ex.get(k))
        out["_line"].append(line)
        out["_drop"].append(drop)
        out["_error"].append(error)
        out["_notes"].append(notes)
    return out


def _feature(spec: Any) -> Any:
    """A ``datasets`` feature from a type string (``"int32[]"``: a list of int32) or a feature itself."""
    import datasets

    if not isinstance(spec, str):
        return spec
    if spec.endswith("[]"):
        return datasets.Sequence(datasets.Value(spec[:-2]))
    return datasets.Value(spec)


def _out_features(job: Job, sample: dict[str, Any] | None) -> tuple[Any, list[str]]:
    import datasets

    features = job.features
    if features is None:  # inferred from one converted example
        if sample is None:
            raise DataError("no row could be converted to infer the example fields")
        features = datasets.Dataset.from_list([sample]).features
    feats = datasets.Features({k: _feature(v) for k, v in dict(features).items()})
    fields = list(feats)
    feats["_line"] = datasets.Value("int64")
    feats["_drop"] = feats["_error"] = datasets.Value("string")
    feats["_notes"] = datasets.Sequence(datasets.Value("string"))
    return feats, fields


def prepare(src: Source, job: Job, root: Path) -> Path:
    """The prepared folder of ``src`` (module docstring), made now unless the cache has it."""
    # the key of a folder or Hub set names its Arrow files, so those are opened here; a file's is its stat
    typed = open_typed(src) if src.kind in ("folder", "hub") else None
    key, fields = cache_key(src, job, typed)
    final = cache_dir_for(root, src, key)
    if (final / "manifest.json").is_file():
        log.info(f"Data cache hit: {src.name} -> {final}")
        return final
    root.mkdir(parents=True, exist_ok=True)
    build = root / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    build.mkdir()
    try:
        _build(src, job, typed, build, fields)
        try:
            build.rename(final)
        except OSError:  # another process finished the same key first: theirs is as good
            if not (final / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return final


def _build(src: Source, job: Job, typed: Any, build: Path, key_fields: dict[str, Any]) -> None:
    """Fill ``build`` (module docstring): in a forked child process where the platform can fork, so
    what preparation imports and allocates is not kept by this (training) process; here otherwise."""
    if "fork" not in multiprocessing.get_all_start_methods():
        _build_here(src, job, typed, build, key_fields)
    else:
        run_forked(_build_here, src, job, typed, build, key_fields)


def run_forked(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` in a forked child; its exception is raised here (a UserError as the same type and
    message, anything else as a RuntimeError carrying the child's traceback)."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_forked_main, args=(send, fn, args), daemon=False)
    proc.start()
    send.close()
    try:
        status = recv.recv()
    except EOFError:
        status = ("crash", "")
    proc.join()
    recv.close()
    if status[0] == "ok":
        return
    if status[0] == "user":
        cls, message, cause = status[1:]
        raise cls(message, cause=cause) if issubclass(cls, DataError) else cls(message)
    raise RuntimeError(f"data preparation failed in its child process (exit code {proc.exitcode}):\n{status[1]}")


def _forked_main(send: Any, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
        status: tuple[Any, ...] = ("ok",)
    except UserError as e:
        status = ("user", type(e), str(e), getattr(e, "cause", "malformed"))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        status = ("crash", traceback.format_exc())
    send.send(status)
    send.close()


def _build_here(src: Source, job: Job, typed: Any, build: Path, key_fields: dict[str, Any]) -> None:
    import datasets

    start = time.perf_counter()
    if typed is None and src.typed:
        typed = open_typed(src)
    if typed is None:
        n_raw = write_raw_rows(src, build / "raw.arrow")
        rows = datasets.Dataset.from_file(str(build / "raw.arrow"))
    else:
        rows, n_raw = typed, len(typed)
    if n_raw == 0:
        raise DataError(f"{src.spec}: the data file has no rows", cause="empty file")
    sample = None if job.features is not None else _first_example(src, job, rows)
    feats, fields = _out_features(job, sample)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the map workers fork after the tokenizer ran
    num_proc = max(1, min(job.num_proc, n_raw // 1000 or 1))
    log.info(f"Preparing {src.name}: tokenising {n_raw} rows once with data.num_proc={num_proc} (other ranks wait, "
             "up to distributed.timeout_minutes; `alignkit prepare CONFIG` does this ahead of a run)")

    # datasets' own bar where alignkit shows bars; elsewhere (logs to a file) the lines around it say enough
    (datasets.enable_progress_bars if progress.use_bar() else datasets.disable_progress_bars)()
    out = rows.map(_convert_batch, batched=True, batch_size=500, with_indices=typed is not None,
                   remove_columns=rows.column_names, features=feats, num_proc=num_proc if num_proc > 1 else None,
                   fn_kwargs={"job": job, "name": src.name, "kind": src.kind, "fields": fields},
                   cache_file_name=str(build / "data.arrow"), new_fingerprint=key_fields_hash(key_fields),
                   desc=f"preparing {src.spec}", load_from_cache_file=False)
    files = [Path(f["filename"]).name for f in out.cache_files]
    drop = out.data.column("_drop")
    keep = np.flatnonzero(drop.is_null().to_numpy(zero_copy_only=False)).astype(np.int64)
    np.save(build / "keep.npy", keep)
    counts = row_counts(out.data.table, src.name, len(out))
    errors = out.data.column("_error")
    first = int(np.argmax(errors.is_valid().to_numpy(zero_copy_only=False))) if errors.null_count < len(out) else None
    manifest = {
        "source": src.name, "files": files, "rows": len(out), "kept": int(len(keep)), "fields": fields,
        "counts": _counts_json(counts), "first_error": None if first is None else
        {"position": first, "message": errors[first].as_py(), "cause": drop[first].as_py()},
        "seconds": round(time.perf_counter() - start, 2), "key": key_fields,
        "columns": write_columns(out.data.table, fields, build),
    }
    del out, rows
    (build / "raw.arrow").unlink(missing_ok=True)
    (build / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str), encoding="utf-8")
    log.info(f"Prepared {src.name}: {n_raw} rows -> {len(keep)} examples in {manifest['seconds']:.1f}s "
             f"(num_proc={num_proc})")


def key_fields_hash(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _first_example(src: Source, job: Job, rows: Any) -> dict[str, Any] | None:
    """One converted example (to infer the fields of a pipeline that gives none)."""
    for i in range(min(len(rows), 1000)):
        batch = rows[i : i + 1]
        got = _convert_batch(batch, [i] if src.typed else None, job=job, name=src.name, kind=src.kind, fields=[])
        if got["_drop"][0] is None:
            data = {k: v[0] for k, v in batch.items()} if src.typed else parse_raw(src.name, src.kind, batch["line"][0], batch["raw"][0])
            return job.convert(Row(data, src.name, batch["line"][0] if not src.typed else i + 1))
    return None


def row_counts(table: Any, name: str, upto: int) -> RowCounts:
    """What happened to the first ``upto`` rows of ``table`` (a ``pyarrow.Table`` of a prepared folder),
    dropped or noted, by cause."""
    counts = RowCounts()
    part = table.slice(0, upto) if upto < table.num_rows else table
    drops = part.column("_drop")
    for pos in np.flatnonzero(drops.is_valid().to_numpy(zero_copy_only=False)):
        cause, error = drops[int(pos)].as_py(), part.column("_error")[int(pos)].as_py()
        where = f"{name}:{part.column('_line')[int(pos)].as_py()}"
        counts.drop(cause, error if cause == "malformed" and error else where)
    import pyarrow.compute as pc

    n_notes = pc.list_value_length(part.column("_notes")).to_numpy(zero_copy_only=False)
    for pos in np.flatnonzero(np.nan_to_num(n_notes.astype(float)) > 0):
        where = f"{name}:{part.column('_line')[int(pos)].as_py()}"
        for note in part.column("_notes")[int(pos)].as_py():
            cause, warn = note.rsplit("\t", 1)
            counts.keep(cause, where, warn=warn == "1")
    return counts


def _counts_json(c: RowCounts) -> dict[str, Any]:
    return {"dropped": dict(c.dropped), "kept": dict(c.kept), "first": c.first, "warn": sorted(c.warn)}


def counts_from_json(d: dict[str, Any]) -> RowCounts:
    c = RowCounts()
    c.dropped.update(d["dropped"])
    c.kept.update(d["kept"])
    c.first.update(d["first"])
    c.warn.update(d["warn"])
    return c


@dataclass
class Prepared:
    """A prepared source opened for reading: kept positions, manifest; ``rows`` (the example fields:
    numpy columns where preparation wrote them, else the Arrow table) and ``table`` (every column, the
    bookkeeping ones too, as a memory-mapped ``pyarrow.Table``; opened on first use)."""

    keep: np.ndarray
    manifest: dict[str, Any]
    folder: Path
    _table: Any = None

    @property
    def files(self) -> list[str]:
        """The Arrow files of the rows."""
        return [str(self.folder / f) for f in self.manifest["files"]]

    @property
    def table(self) -> Any:
        if self._table is None:
            import pyarrow as pa

            parts = [read_arrow(Path(f)) for f in self.files]
            self._table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        return self._table

    @property
    def rows(self) -> Any:
        kinds = self.manifest.get("columns")
        if kinds and set(self.manifest["fields"]) <= set(kinds):
            return Columns.open(self.folder, kinds, self.manifest["rows"])
        return self.table


def read_arrow(path: Path) -> Any:
    """The ``pyarrow.Table`` of one Arrow file ``datasets`` wrote (the IPC stream format), memory-mapped:
    its buffers point into the mapped file, so the rows are paged in by the OS, not copied."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:  # the table keeps its own reference to the mapping
        return pa.ipc.open_stream(source).read_all()


def open_prepared(folder: Path) -> Prepared:
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    return Prepared(np.load(folder / "keep.npy", mmap_mode="r"), manifest, folder)
