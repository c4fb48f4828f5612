"""``alignkit train configs/redteam.yaml`` end to end on tiny models: the micro Llama as attacker (LoRA) and
target, a tiny random text classifier as the toxicity scorer, in one process and under 2-process DDP
(placement main: the classifier on rank 0 only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, assert_ok, jsonl, run_cli
from tests.plugins.redteam_parts import cli_parts, tiny_train_args


@pytest.fixture(scope="module")
def parts(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return cli_parts(tmp_path_factory.mktemp("redteam"), micro_model)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_shipped_config_trains_on_tiny_models(micro_model: Path, parts: dict[str, Path], tmp_path: Path, nproc: int) -> None:
    out = tmp_path / "run"
    args = tiny_train_args(str(REPO / "configs" / "redteam.yaml"), str(out), str(micro_model), str(parts["train"]),
                           str(parts["eval"]), nproc, generations=4, batch=8, max_new_tokens=8)
    args += [f"redteam.target.model={micro_model}", "redteam.target.max_new_tokens=8",
             f"redteam.scorers=[{{name: toxicity, model: '{parts['classifier']}'}}]"]
    assert_ok(run_cli(args, nproc=nproc, cwd=REPO, timeout=400))
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for key in ("reward_mean", "toxicity_mean", "cvar_bonus_mean", "var", "similarity_mean", "attack_success_rate",
                "distinct_attacks", "kl", "toxicity/toxicity"):
        assert key in train[-1], key
    assert any("eval/reward_mean" in r for r in logged)
    rows = jsonl(out / "attacks.jsonl")
    assert len(rows) == 16 and {r["step"] for r in rows} == {1, 2}
    # every logged toxicity is the classifier's mean head sigmoid on that row's target output
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(parts["classifier"])
    model = AutoModelForSequenceClassification.from_pretrained(parts["classifier"]).eval()
    with torch.no_grad():
        want = [model(**tok([r["output"] or " "], return_tensors="pt")).logits.sigmoid().mean().item() for r in rows]
    assert [r["toxicity"] for r in rows] == pytest.approx(want, abs=1e-4)
    assert all(r["reward"] == pytest.approx(r["toxicity"] + 0.1 * r["cvar_bonus"] - 0.1 * r["similarity"]) for r in rows)
    assert (out / "final" / "adapter_config.json").is_file()  # the LoRA attacker
    top = (out / "top_attacks.md").read_text().splitlines()
    assert len(top) == 2 + min(20, len({r["attack"].strip() for r in rows}))
    assert float(top[2].split("|")[2]) == pytest.approx(max(r["toxicity"] for r in rows), abs=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
def test_shipped_config_under_accelerate_one_node_and_two_node_loopback(micro_model: Path, parts: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """The guide's launch forms: ``accelerate launch --num_processes 2`` on one node, and two "machines" on this
    one (``--num_machines 2 --machine_rank R --main_process_ip 127.0.0.1``), both through ``alignkit launch
    --launcher accelerate``: the same 2-rank run, so the same attacks and the same trained adapter."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.conftest import child_env, free_port, run_nodes

    def args(out: Path) -> list[str]:
        train = tiny_train_args(str(REPO / "configs" / "redteam.yaml"), str(out), str(micro_model), str(parts["train"]),
                                str(parts["eval"]), 2, generations=4, batch=8, max_new_tokens=8)[1:]
        return [*train, f"redteam.target.model={micro_model}", "redteam.target.max_new_tokens=8",
                f"redteam.scorers=[{{name: toxicity, model: '{parts['classifier']}'}}]"]

    launch = [sys.executable, "-m", "alignkit", "launch", "--launcher", "accelerate"]
    one = tmp_path / "one_node"
    assert_ok(subprocess.run([*launch, "--nproc-per-node", "2", "--master-port", str(free_port()), *args(one)],
                             capture_output=True, text=True, timeout=400, cwd=REPO, env=child_env()))
    two, port = tmp_path / "two_nodes", str(free_port())
    run_nodes([[*launch, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                "--master-port", port, *args(two)] for r in (0, 1)], timeout=400, cwd=REPO)
    attacks = [[x["attack"] for x in jsonl(run / "attacks.jsonl")] for run in (one, two)]
    assert len(attacks[0]) == 16 and attacks[0] == attacks[1]
    a, b = (load_file(run / "final" / "adapter_model.safetensors") for run in (one, two))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
