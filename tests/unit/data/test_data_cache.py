"""The Arrow data path: the same numbers as the list path it replaced, the cache key (hit, and a miss
after editing a row, changing max_length or the chat template), errors that still name file and
line, Hub names from a local ``datasets`` cache with no network, load_from_disk folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from alignkit.algorithms import ALGORITHMS
from alignkit.config import load_config
from alignkit.data import cache
from alignkit.data.examples import ExampleTable
from alignkit.data.io import convert_rows
from alignkit.data.preference import load_pairs
from alignkit.errors import DataError
from alignkit.models.loading import load_tokenizer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "data_numbers"


def _algo(micro_model: Path, *overrides: str) -> Any:
    cfg = load_config(None, [f"model.name_or_path={micro_model}", "training.per_device_batch_size=4", *overrides],
                      notes=False)
    return ALGORITHMS.get(cfg.algorithm)(cfg, load_tokenizer(cfg.model)), cfg


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Names of the sources tokenised (prepared) from here on, in a cache of this test's own."""
    monkeypatch.setenv("ALIGNKIT_DATA_CACHE", str(tmp_path / "cache"))
    done: list[str] = []
    real = cache._build

    def counted(src: Any, *args: Any) -> None:
        done.append(src.name)
        real(src, *args)

    monkeypatch.setattr(cache, "_build", counted)
    return done


@pytest.mark.parametrize("name", ["sft", "sft_packed", "dpo", "cost_model"])
def test_same_numbers_as_the_list_path(name: str, micro_model: Path, builds: list[str]) -> None:
    """Losses and eval metrics of short runs equal those recorded on main with the list path (fd14c80)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("record", FIXTURES / "record.py")
    record = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(record)  # type: ignore[union-attr]
    expected = json.loads((FIXTURES / "main_fd14c80.json").read_text())[name]
    got = record.run(str(micro_model), name)
    assert builds  # it did go through the cache
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-6, abs=1e-7)
    # recorded on another machine: the DPO eval metrics are beta x differences of near-equal log-prob sums,
    # which amplify the CPU's floating-point kernel differences (measured up to 1.1e-4 relative, 2.9e-7
    # absolute between two 2-core machines); a changed token would move them by orders of magnitude more
    assert got["eval"] == pytest.approx(expected["eval"], rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("overrides", [
    ["algorithm=sft", "data.train=builtin:sft_train.jsonl", "data.max_length=40"],
    ["algorithm=sft", "data.train=builtin:sft_pc_train.jsonl", "data.packing=true", "data.max_length=20"],
    ["algorithm=dpo", "data.train=builtin:pref_train.jsonl", "data.max_length=30"],
    ["algorithm=cost_model", "data.train=builtin:safety_train.jsonl", "data.max_length=48"],
])
def test_same_batches_as_the_list_path(overrides: list[str], micro_model: Path, builds: list[str]) -> None:
    algo, cfg = _algo(micro_model, *overrides)
    table = algo.data.build_dataset(cfg.data.train, "train")
    d = cfg.data
    if cfg.algorithm == "sft":
        listed, counts = convert_rows(d.train, algo.data.convert, skip_invalid=False)
    else:
        listed, counts = load_pairs(algo.tokenizer, d.train, max_length=d.max_length, pair=algo.data.pair,
                                    chat_template=d.chat_template, skip_invalid=False,
                                    need_safety_labels=algo.data.needs_safety_labels)
    assert isinstance(table, ExampleTable) and len(table) == len(listed)
    assert algo.data.row_counts["train"].lines() == counts.lines()
    for idx in ([0, 1, 2, 3], [len(listed) - 1, 7, 100, 5]):
        a, b = algo.data.collate(table.__getitems__(idx)), algo.data.collate([listed[i] for i in idx])
        assert a.keys() == b.keys()
        for k in a:
            if not isinstance(a[k], torch.Tensor):  # a packed row's host-side boundaries (ints)
                assert a[k] == b[k], k
                continue
            assert torch.equal(a[k], b[k]) or (a[k].isnan().all() and b[k].isnan().all()), k


def _pref_file(path: Path, n: int = 12) -> Path:
    rows = [{"prompt": f"What is {i}+1?", "chosen": f"{i + 1}.", "rejected": f"{i + 2}."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_cache_hit_and_invalidation(micro_model: Path, tmp_path: Path, builds: list[str]) -> None:
    data = _pref_file(tmp_path / "pairs.jsonl")
    algo, cfg = _algo(micro_model, "algorithm=dpo", f"data.train={data}", "data.max_length=32")
    first = algo.data.build_dataset(cfg.data.train, "train")
    assert len(builds) == 1
    again = algo.data.build_dataset(cfg.data.train, "train")  # same process
    algo2, _ = _algo(micro_model, "algorithm=dpo", f"data.train={data}", "data.max_length=32")  # a new run
    algo2.data.build_dataset(cfg.data.train, "train")
    assert len(builds) == 1 and again[3] == first[3]
    # an edited row: a new key, and the new text is what the examples hold
    lines = data.read_text().splitlines()
    lines[3] = json.dumps({"prompt": "What is 3+1?", "chosen": "four.", "rejected": "five."})
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    edited = algo.data.build_dataset(cfg.data.train, "train")
    assert len(builds) == 2 and edited[3] != first[3] and edited[2] == first[2]
    # max_length, the chat template (of the tokenizer, or data.chat_template for string rows)
    short, _ = _algo(micro_model, "algorithm=dpo", f"data.train={data}", "data.max_length=8")
    assert max(len(e["chosen_ids"]) for e in short.data.build_dataset(cfg.data.train, "train")) <= 8
    assert len(builds) == 3
    algo.tokenizer.chat_template = algo.tokenizer.chat_template.replace("<|assistant|>", "<|ai|>") \
        if "<|assistant|>" in algo.tokenizer.chat_template else algo.tokenizer.chat_template + " "
    algo.data.build_dataset(cfg.data.train, "train")
    assert len(builds) == 4
    templated, _ = _algo(micro_model, "algorithm=dpo", f"data.train={data}", "data.max_length=32",
                         "data.chat_template=true")
    templated.data.build_dataset(cfg.data.train, "train")
    assert len(builds) == 5


def test_malformed_rows_name_file_and_line(micro_model: Path, tmp_path: Path, builds: list[str]) -> None:
    data = _pref_file(tmp_path / "pairs.jsonl")
    lines = data.read_text().splitlines()
    lines[2] = '{"prompt": "x", "chosen": "y"'  # line 3: not JSON
    lines[5] = json.dumps({"prompt": "x", "chosen": 5, "rejected": "z"})  # line 6: a field of the wrong type
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    algo, cfg = _algo(micro_model, "algorithm=dpo", f"data.train={data}", "data.max_length=32")
    with pytest.raises(DataError, match=rf"^{data}:3: not valid JSON"):
        algo.data.build_dataset(cfg.data.train, "train")
    skip, cfg2 = _algo(micro_model, "algorithm=dpo", f"data.train={data}", "data.max_length=32",
                       "data.skip_invalid=true")
    examples = skip.data.build_dataset(cfg2.data.train, "train")
    assert len(examples) == 10 and len(builds) == 1  # one preparation serves both settings
    counts = skip.data.row_counts["train"]
    assert counts.dropped == {"not valid JSON": 1, "malformed": 1}
    assert counts.first["not valid JSON"] == f"{data}:3"
    assert counts.first["malformed"].startswith(f"{data}:6 field 'chosen'")
    # a row error past max_train_examples is not read, as before
    limited, cfg3 = _algo(micro_model, "algorithm=dpo", f"data.train={data}", "data.max_train_examples=2")
    assert len(limited.data.build_dataset(cfg3.data.train, "train")) == 2


def test_empty_file_and_no_usable_rows(micro_model: Path, tmp_path: Path, builds: list[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    algo, cfg = _algo(micro_model, "algorithm=dpo", f"data.train={empty}")
    with pytest.raises(DataError, match="has no rows"):
        algo.data.build_dataset(cfg.data.train, "train")


def _hub_cache(root: Path, repo: str, rows: Path) -> None:
    """What downloading ``repo`` leaves in a datasets cache folder (built here from a local file)."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json

    org, name = repo.split("/")
    builder = Json(cache_dir=str(root), dataset_name=name, config_name="default", hash="0123abcd",
                   data_files=DataFilesDict.from_patterns({"train": [str(rows)]}))
    builder.download_and_prepare()
    made = next(root.glob(f"{name}/default-*"))
    (root / f"{org}___{name}").mkdir()
    made.rename(root / f"{org}___{name}" / "default")
    for lock in root.rglob("*.lock"):
        lock.unlink()


def test_hub_name_from_the_local_datasets_cache(micro_model: Path, tmp_path: Path, builds: list[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets.config as dc

    rows = _pref_file(tmp_path / "pairs.jsonl", n=9)
    _hub_cache(tmp_path / "hf", "acme/tiny-pairs", rows)
    monkeypatch.setattr(dc, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(dc, "HF_HUB_OFFLINE", True)  # the network is never asked
    algo, cfg = _algo(micro_model, "algorithm=dpo", "data.train=acme/tiny-pairs", "data.max_length=32")
    hub = algo.data.build_dataset(cfg.data.train, "train")
    local = algo.data.build_dataset([str(rows)], "eval")
    assert len(hub) == 9 and [hub[i] for i in range(9)] == [local[i] for i in range(9)]
    with pytest.raises(DataError, match=r"^data set 'acme/missing': not in the local datasets cache .* offline"):
        algo.data.build_dataset(["acme/missing"], "train")
    with pytest.raises(DataError, match="split"):
        algo.data.build_dataset(["acme/tiny-pairs"], "eval")  # data.eval_split=test: the set has none


def test_load_from_disk_folder_and_parquet(micro_model: Path, tmp_path: Path, builds: list[str]) -> None:
    import datasets

    rows = [json.loads(x) for x in _pref_file(tmp_path / "pairs.jsonl", n=6).read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pairs.parquet"))
    algo, cfg = _algo(micro_model, "algorithm=dpo", f"data.train={tmp_path / 'saved'}", "data.max_length=32")
    folder = algo.data.build_dataset(cfg.data.train, "train")
    parquet = algo.data.build_dataset([str(tmp_path / "pairs.parquet")], "train")
    jsonl = algo.data.build_dataset([str(tmp_path / "pairs.jsonl")], "train")
    assert [folder[i] for i in range(6)] == [jsonl[i] for i in range(6)] == [parquet[i] for i in range(6)]
