"""Where rows come from: a file (.jsonl / .json / .parquet), a ``load_from_disk`` folder, or a Hub
name (``org/name``, with a config and split), and what identifies their content for the cache.

Text files are read into an Arrow file of raw rows (``line``, ``raw`` bytes), so malformed lines
(not UTF-8, not JSON) reach the same per-row checks as the rest and keep their ``file:line``
errors; typed sources (parquet, folders, the Hub) are Arrow already and are read by row number.
A Hub name is looked up in the local ``datasets`` cache first, with the Hub switched off, and on
the network only when that fails and offline mode is not set (``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from alignkit.constants import BUILTIN_PREFIX
from alignkit.data.io import parse_jsonl_line, read_json_list, resolve_path
from alignkit.errors import DataError

#: ``org/name`` (or a bare ``name``) that is not a file on disk: a data set on the Hugging Face Hub
HUB_NAME = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Source:
    """One entry of ``data.train`` / ``data.eval``. ``name`` is what ``file:line`` messages show."""

    spec: str
    kind: str  # jsonl | json | parquet | folder | hub
    name: str
    path: Path | None = None
    split: str | None = None
    config: str | None = None

    @property
    def typed(self) -> bool:
        """Rows come as Arrow columns (not raw text lines to parse)."""
        return self.kind in ("parquet", "folder", "hub")


def resolve_source(spec: str, *, split: str | None = None, config: str | None = None) -> Source:
    """The source ``spec`` names; a DataError for a path that does not exist and is no Hub name."""
    if not spec.startswith(BUILTIN_PREFIX):
        p = Path(spec).expanduser()
        if p.is_dir():
            return Source(spec, "folder", str(p.resolve()), p.resolve(), split, config)
        if not p.exists() and p.suffix.lower() not in FILE_KINDS and HUB_NAME.match(spec):
            return Source(spec, "hub", f"{spec}[{split or 'train'}]", None, split or "train", config)
    path = resolve_path(spec)
    kind = FILE_KINDS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: unsupported data file type {path.suffix!r}; use .jsonl, .json or .parquet, "
                        "a load_from_disk folder or a Hub name (org/name)")
    return Source(spec, kind, str(path), path, split, config)


def fingerprint(src: Source, typed: Any = None) -> dict[str, Any]:
    """What identifies the source's content: path, size and modification time of every file
    (of the Arrow cache files for a folder or a Hub set, ``typed`` being that set)."""
    if src.kind in ("jsonl", "json", "parquet"):
        assert src.path is not None
        st = src.path.stat()
        return {"kind": src.kind, "path": str(src.path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    files = sorted(f["filename"] for f in (typed.cache_files if typed is not None else []))
    stats = [(f, Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in files]
    if not stats:  # an in-memory set: its own fingerprint
        stats = [("fingerprint", getattr(typed, "_fingerprint", ""), 0)]
    return {"kind": src.kind, "name": src.name, "config": src.config, "files": stats}


def open_typed(src: Source) -> Any:
    """A ``datasets.Dataset`` of the typed source's rows (memory-mapped where the source is Arrow)."""
    import datasets

    if src.kind == "parquet":
        import pyarrow.parquet as pq

        return datasets.Dataset(pq.read_table(src.path, memory_map=True))
    if src.kind == "folder":
        try:
            ds = datasets.load_from_disk(str(src.path))
        except FileNotFoundError:
            raise DataError(f"{src.spec}: a folder must be a data set saved with save_to_disk "
                            "(dataset_info.json, state.json)") from None
        if isinstance(ds, datasets.DatasetDict):
            split = src.split or "train"
            if split not in ds:
                raise DataError(f"{src.spec}: no split {split!r} (has {sorted(ds)})")
            ds = ds[split]
        return ds
    return open_hub(src.spec, src.config, src.split or "train")


@contextmanager
def _hub_offline() -> Iterator[None]:
    """Both switches ``datasets`` and ``huggingface_hub`` read, set for the block."""
    import datasets.config as dc
    import huggingface_hub.constants as hc

    saved = dc.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE
    dc.HF_HUB_OFFLINE = hc.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dc.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE = saved


def open_hub(name: str, config: str | None, split: str) -> Any:
    """A Hub data set's split: from the local ``datasets`` cache when it is there (no network), else
    downloaded unless offline; a one-line DataError when neither has it."""
    import datasets
    import datasets.config as dc

    def load() -> Any:
        return datasets.load_dataset(name, config, split=split)

    cache = dc.HF_DATASETS_CACHE
    try:
        with _hub_offline():
            return load()
    except ValueError as e:  # the set is cached but not this config or split
        if "split" in str(e).lower() or "config" in str(e).lower():
            raise DataError(f"data set {name!r}: {str(e).splitlines()[0]}") from None
    except (ConnectionError, FileNotFoundError, OSError):
        pass
    if dc.HF_HUB_OFFLINE:
        raise DataError(f"data set {name!r}: not in the local datasets cache ({cache}) and offline mode is on "
                        "(HF_HUB_OFFLINE); download it once with network, or give a file path") from None
    try:
        return load()
    except Exception as e:  # noqa: BLE001 - any failure here is one line for the user
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"data set {name!r}: not in the local datasets cache ({cache}) and the Hub did not "
                        f"provide it ({why})") from None


#: the raw-row table of a text file: one row per non-blank line (jsonl) or list element (json)
RAW_FEATURES = {"line": "int64", "raw": "binary"}


def write_raw_rows(src: Source, out: Path) -> int:
    """Write the rows of a .jsonl / .json file to the Arrow file ``out`` (``line``, ``raw`` bytes);
    returns the row count. A .json file that is not one valid list of objects is a DataError here
    (it has no rows to check one by one)."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    features = datasets.Features({k: datasets.Value(v) for k, v in RAW_FEATURES.items()})
    assert src.path is not None
    with ArrowWriter(path=str(out), features=features) as writer:
        for line, raw in _raw_rows(src.path, src.kind):
            writer.write({"line": line, "raw": raw})
        n, _ = writer.finalize()
    return n


def _raw_rows(path: Path, kind: str) -> Iterator[tuple[int, bytes]]:
    if kind == "jsonl":
        with path.open("rb") as fh:
            for i, raw in enumerate(fh, start=1):
                if raw.strip():
                    yield i, raw
        return
    for i, o in enumerate(read_json_list(path), start=1):
        yield i, json.dumps(o).encode("utf-8")


def parse_raw(src_name: str, kind: str, line: int, raw: bytes) -> dict[str, Any]:
    """A raw row back to its object (the same errors as reading the file directly)."""
    if kind == "jsonl":
        return parse_jsonl_line(raw, Path(src_name), line)
    return json.loads(raw)
