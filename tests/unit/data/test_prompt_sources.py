"""Prompt sets of the online algorithms (data/prompts.py) from load_from_disk folders and Hub names, with
``data.prompt_column`` (GSM8K's ``question``) and ``data.system_prompt``; and the GSM8K recipe validated on such
a folder (the real example file, only the model and the data set's location replaced)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from alignkit.config.schema import DataConfig
from alignkit.data import prompts
from alignkit.data.prompts import PromptData
from alignkit.errors import DataError
from tests.conftest import REPO, assert_ok, run_cli

SYSTEM = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_like(n: int) -> dict[str, list[str]]:
    return {"question": [f"Tom has {i} apples and buys {i + 1} more. How many apples?" for i in range(n)],
            "answer": [f"He has {i}+{i + 1}=<<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}.\n#### {2 * i + 1}"
                       for i in range(n)]}


@pytest.fixture(scope="module")
def gsm8k_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import datasets

    root = tmp_path_factory.mktemp("gsm8k") / "gsm8k"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(gsm8k_like(40)),
                          "test": datasets.Dataset.from_dict(gsm8k_like(5))}).save_to_disk(str(root))
    return root


def tokenizer(micro_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(micro_model)


def test_a_folder_with_a_prompt_column_and_a_system_turn(gsm8k_folder: Path, micro_model: Path) -> None:
    tok = tokenizer(micro_model)
    cfg = DataConfig(train=[str(gsm8k_folder)], prompt_column="question", system_prompt=SYSTEM)
    rows = PromptData(tok, cfg, max_new_tokens=16).build_dataset(cfg.train, "train")
    assert len(rows) == 40
    first = rows[0]
    assert first["prompt"] == gsm8k_like(1)["question"][0]  # as written: what the reward functions see
    assert first["fields"] == {"answer": gsm8k_like(1)["answer"][0]}  # the question is not repeated there
    text = tok.decode(first["prompt_ids"])
    assert text.index(SYSTEM) < text.index("Tom has 0 apples"), text  # the system turn, then the user's
    test = PromptData(tok, cfg, max_new_tokens=16).build_dataset([str(gsm8k_folder)], "eval")  # eval_split: test
    assert len(test) == 5
    plain = PromptData(tok, DataConfig(train=[str(gsm8k_folder)], prompt_column="question"), max_new_tokens=16)
    assert SYSTEM not in tok.decode(plain.build_dataset(cfg.train, "train")[0]["prompt_ids"])


def test_without_the_prompt_column_the_row_is_named(gsm8k_folder: Path, micro_model: Path) -> None:
    cfg = DataConfig(train=[str(gsm8k_folder)])  # prompt_column: prompt, which GSM8K does not have
    with pytest.raises(DataError, match=r"missing field 'prompt' \(row has \['answer', 'question'\]\)"):
        PromptData(tokenizer(micro_model), cfg, max_new_tokens=16).build_dataset(cfg.train, "train")


def test_a_hub_name_is_opened_with_the_splits_config(micro_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    opened = []

    def fake_open(src: Any) -> Any:
        opened.append((src.kind, src.spec, src.config, src.split))
        return datasets.Dataset.from_dict(gsm8k_like(3))

    monkeypatch.setattr(prompts, "open_typed", fake_open)
    cfg = DataConfig(train=["openai/gsm8k"], train_config="main", eval_config="main", prompt_column="question")
    data = PromptData(tokenizer(micro_model), cfg, max_new_tokens=16)
    assert len(data.build_dataset(["openai/gsm8k"], "train")) == 3
    assert len(data.build_dataset(["openai/gsm8k"], "eval")) == 3
    assert opened == [("hub", "openai/gsm8k", "main", "train"), ("hub", "openai/gsm8k", "main", "test")]


def test_the_gsm8k_recipe_validates(gsm8k_folder: Path, micro_model: Path, tmp_path: Path) -> None:
    """examples/grpo_qwen2.5-1.5b_gsm8k.yaml as shipped (separate placement, vLLM, math_verify), on 8 processes,
    with the micro model for Qwen and a folder of GSM8K's columns for openai/gsm8k: 6 trainers x 32 = 192."""
    pytest.importorskip("math_verify")
    text = (REPO / "examples" / "grpo_qwen2.5-1.5b_gsm8k.yaml").read_text(encoding="utf-8")
    assert "train: openai/gsm8k" in text and "eval: openai/gsm8k" in text and "prompt_column: question" in text
    text = text.replace("Qwen/Qwen2.5-1.5B-Instruct", str(micro_model)).replace("openai/gsm8k", str(gsm8k_folder))
    (tmp_path / "gsm8k.yaml").write_text(text, encoding="utf-8")
    proc = run_cli(["validate", "gsm8k.yaml", "--world-size", "8"], cwd=tmp_path)
    assert_ok(proc)
    assert "processes                            6" in proc.stdout and "global batch                         192" \
        in proc.stdout, proc.stdout[-1500:]
    assert "training examples                    40 (0 skipped)" in proc.stdout


def test_separate_placement_reserves_no_engine_memory_on_the_trainers() -> None:
    """The recipe's vLLM engine (gpu_memory_utilization 0.7) lives on the generators: the trainers' memory plan
    keeps it all (before, auto sized them as if 70% were taken and picked ZeRO-2, which separate refuses)."""
    from alignkit.algorithms import ALGORITHMS
    from alignkit.config.loader import load_config

    path = str(REPO / "examples" / "grpo_qwen2.5-1.5b_gsm8k.yaml")
    grpo = ALGORITHMS.get("grpo")
    assert grpo.reserved_memory_fraction(load_config(path, [])) == 0.0
    colocated = load_config(path, ["rollout.placement=colocated", "rollout.max_staleness=0"])
    assert grpo.reserved_memory_fraction(colocated) == pytest.approx(0.7)
