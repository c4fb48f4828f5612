"""Mixtures: ``data.train`` as a list of {path, weight} (config forms and their errors), and the
examples a mixture draws from each source."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from alignkit.algorithms import ALGORITHMS
from alignkit.config import load_config
from alignkit.errors import ConfigError
from alignkit.models.loading import load_tokenizer
from tests.conftest import write_config


def _cfg(tmp_path: Path, train: object, **data: object):  # type: ignore[no-untyped-def]
    path = write_config(tmp_path / "c.yaml", {"algorithm": "sft", "model": {"name_or_path": "m"},
                                              "data": {"train": train, **data},
                                              "training": {"per_device_batch_size": 2}})
    return load_config(path, notes=False)


def test_train_forms(tmp_path: Path) -> None:
    assert _cfg(tmp_path, "a.jsonl").data.train == ["a.jsonl"]
    assert _cfg(tmp_path, "a.jsonl").data.train_weights == []
    cfg = _cfg(tmp_path, [{"path": "a.jsonl", "weight": 0.7}, {"path": "b.jsonl", "weight": 0.3}])
    assert cfg.data.train == ["a.jsonl", "b.jsonl"] and cfg.data.train_weights == [0.7, 0.3]
    cfg = _cfg(tmp_path, [{"path": "a.jsonl", "weight": 2}, "b.jsonl"])  # a bare path weighs 1
    assert cfg.data.train_weights == [2.0, 1.0]
    cfg = _cfg(tmp_path, {"path": "org/name"})
    assert cfg.data.train == ["org/name"] and cfg.data.train_weights == [1.0]
    over = load_config(None, ["algorithm=sft", "model.name_or_path=m", "training.per_device_batch_size=2",
                              "data.train=[{path: a.jsonl, weight: 3}, {path: b.jsonl}]"], notes=False)
    assert over.data.train == ["a.jsonl", "b.jsonl"] and over.data.train_weights == [3.0, 1.0]


@pytest.mark.parametrize("train, data, message", [
    ([{"path": "a.jsonl", "wieght": 1}], {}, r"data.train\[0\]: unknown key 'wieght' \(did you mean 'weight'\?\)"),
    ([{"weight": 1}], {}, r"data.train\[0\].path: required"),
    ([{"path": "a.jsonl", "weight": -1}], {}, r"data.train\[0\].weight: expected a number > 0, got -1"),
    ([{"path": "a.jsonl", "weight": "x"}], {}, r"data.train\[0\].weight: expected a number > 0"),
    ([{"path": "a.jsonl", "weight": 1}], {"train_weights": [1]}, r"give weights in data.train's entries or here"),
    (["a.jsonl", "b.jsonl"], {"train_weights": [1]}, r"data.train_weights: 1 weights for 2 data.train entries"),
    (["a.jsonl"], {"train_weights": [0]}, r"data.train_weights: every weight must be a number > 0"),
    ([{"path": "a.jsonl"}, 5], {}, r"data.train\[1\]: expected a path or a mapping"),
])
def test_train_form_errors(tmp_path: Path, train: object, data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, train, **data)


def _sft_file(path: Path, tag: str, n: int) -> str:
    rows = [{"prompt": f"{tag} {i}?", "completion": f"{tag}{i}."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_mixture_draws_by_weight(micro_model: Path, tmp_path: Path) -> None:
    a, b = _sft_file(tmp_path / "a.jsonl", "alpha", 10), _sft_file(tmp_path / "b.jsonl", "beta", 30)
    cfg = load_config(None, [f"model.name_or_path={micro_model}", "algorithm=sft", "training.per_device_batch_size=2",
                             f"data.train=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3}}]",
                             f"data.cache_dir={tmp_path / 'cache'}"], notes=False)
    algo = ALGORITHMS.get("sft")(cfg, load_tokenizer(cfg.model))
    mix = algo.data.build_dataset(cfg.data.train, "train")
    texts = [algo.tokenizer.decode(e["input_ids"]) for e in mix]
    src = Counter("alpha" in t for t in texts)
    assert len(mix) == 40 and src[True] == 28 and src[False] == 12  # round(40 x 0.7), round(40 x 0.3)
    per_row = Counter(t for t in texts if "alpha" in t)
    assert sorted(Counter(per_row.values()).items()) == [(2, 2), (3, 8)]  # 2.8 passes over a's 10 rows
    assert len({t for t in texts if "beta" in t}) == 12  # 12 of b's 30, none twice
    assert [e for e in algo.data.build_dataset(cfg.data.train, "train")] == list(mix)  # the same draw again
    plain = algo.data.build_dataset([a, b], "eval")  # no weights: every example once, in order
    assert len(plain) == 40
