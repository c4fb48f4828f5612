"""A training process does not hold ``datasets`` or ``pyarrow``: a warm-cache SFT run imports neither
(it reads the numpy columns), and a cold one prepares the cache in a forked child (where the platform
can fork), with the same losses either way; a folder without numpy columns (an older cache) is read
through Arrow with the same examples."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from alignkit.data.cache import run_forked
from alignkit.errors import DataError

SCRIPT = """
import json, sys
from alignkit.config import load_config
from alignkit.train.runner import run_train
run_train(load_config(sys.argv[1]))
print("MODULES " + json.dumps(sorted(m for m in ("datasets", "pyarrow") if m in sys.modules)))
"""


def _run(cfg: dict[str, Any], tmp_path: Path, name: str, cache: Path) -> tuple[list[str], list[float]]:
    cfg = dict(cfg, output_dir=str(tmp_path / name))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    env = dict(os.environ, ALIGNKIT_DATA_CACHE=str(cache), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MODULES "))
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return json.loads(line[len("MODULES "):]), [r["loss"] for r in rows if "loss" in r]


def test_warm_cache_sft_run_does_not_import_datasets(sft_config: dict[str, Any], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    sft_config["data"]["packing"] = True
    del sft_config["data"]["max_train_examples"]  # a cut reads the row counts of the rows before it from Arrow
    cold_modules, cold_losses = _run(sft_config, tmp_path, "cold", cache)
    assert list(cache.glob("*/manifest.json")), "the first run prepared no cache folder"
    warm_modules, warm_losses = _run(sft_config, tmp_path, "warm", cache)
    assert "datasets" not in warm_modules and "pyarrow" not in warm_modules
    assert len(warm_losses) == 4 and warm_losses == cold_losses
    if "fork" in multiprocessing.get_all_start_methods():  # the preparation ran in a child process
        assert "datasets" not in cold_modules


def _fails_with(exc: BaseException) -> None:
    raise exc


def test_run_forked_raises_the_childs_error() -> None:
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    with pytest.raises(DataError, match="^rows.jsonl:3: bad row$") as got:
        run_forked(_fails_with, DataError("rows.jsonl:3: bad row", cause="malformed"))
    assert got.value.cause == "malformed"
    with pytest.raises(RuntimeError, match=r"(?s)child process.*ValueError: boom"):
        run_forked(_fails_with, ValueError("boom"))
    run_forked(print, "a child that succeeds")


def test_a_folder_without_numpy_columns_reads_through_arrow(micro_model: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from alignkit.algorithms import ALGORITHMS
    from alignkit.config import load_config
    from alignkit.data.columns import Columns
    from alignkit.models.loading import load_tokenizer

    monkeypatch.setenv("ALIGNKIT_DATA_CACHE", str(tmp_path / "cache"))
    cfg = load_config(None, [f"model.name_or_path={micro_model}", "algorithm=dpo", "data.train=builtin:pref_train.jsonl",
                             "data.max_length=30", "training.per_device_batch_size=4"], notes=False)
    algo = ALGORITHMS.get("dpo")(cfg, load_tokenizer(cfg.model))
    new = algo.data.build_dataset(cfg.data.train, "train")
    assert isinstance(new.rows, Columns)
    (folder,) = [f.parent for f in (tmp_path / "cache").glob("*/manifest.json")]
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("columns")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(folder / "columns")
    old = algo.data.build_dataset(cfg.data.train, "train")
    assert not isinstance(old.rows, Columns) and len(old) == len(new)
    idx = [0, 5, len(new) - 1, 17]
    assert old.__getitems__(idx) == new.__getitems__(idx)
    assert any(ex["chosen_unsafe"] is None for ex in new.__getitems__(idx))  # nulls stay None
