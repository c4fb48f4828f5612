"""Red-team RL across ranks (worker: tests/distributed/workers/redteam.py), through the real runner and loop
with the micro model as attacker and target, and a scorer that is a known function of the target's output
(the share of vowels), so every reward can be recomputed from the text it belongs to:

* ``placement: main``: the scorer runs on rank 0 alone, over the 12 samples of both ranks, and each rank
  trains on the toxicity of ITS OWN samples (never rank 0's); ``local``: each rank scores its 6;
* VaR, reward mean / std and the advantage statistics are the same on both ranks;
* 2 processes == 1 process (greedy attacks, global statistics: the same samples): same losses, weights;
* a resumed run continues exactly, attacks.jsonl and top_attacks.md included.

Every 2-process run shares one torchrun launch (the ``launched`` fixture).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import assert_ok, run_script
from tests.plugins.redteam_parts import vowel_share

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parent / "workers" / "redteam.py"
TIMING = ("rollout_s", "update_s")


#: the 2-process runs of this file (folder: mode and overrides), all in ONE torchrun launch (``launched``); the
#: resume first: a ``run`` leaves its rollout spy and score log in place for what follows in the process
GREEDY = ("rollout.temperature=0", "redteam.statistics=global")  # the same attacks whatever the rank seeds
TWO_PROCESS = {"resume": ("resume",), "main": ("run", "redteam.placement=main"),
               "local": ("run", "redteam.placement=local"), "two": ("run", *GREEDY),
               "multi_turn": ("run", "redteam.turns=2")}


@pytest.fixture(scope="module")
def launched(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run of TWO_PROCESS under ``root/<name>``, one after another in one launch of the worker."""
    root = tmp_path_factory.mktemp("redteam")
    args = [str(micro_model)]
    for name, (mode, *overrides) in TWO_PROCESS.items():
        (root / name).mkdir()
        args += [*(["::"] if len(args) > 1 else []), str(root / name), mode, *overrides]
    assert_ok(run_script(WORKER, nproc=2, timeout=900, args=args))
    return root


def ranks_of(out: Path, nproc: int = 2) -> list[list[dict]]:
    return [json.loads((out / f"ranks_{r}.json").read_text()) for r in range(nproc)]


def run(micro_model: Path, out: Path, nproc: int, *overrides: str) -> list[list[dict]]:
    out.mkdir(parents=True, exist_ok=True)
    assert_ok(run_script(WORKER, nproc=nproc, timeout=300, args=[str(micro_model), str(out), "run", *overrides]))
    return ranks_of(out, nproc)


@pytest.mark.parametrize("placement", ["main", "local"])
def test_each_rank_trains_on_the_scores_of_its_own_samples(launched: Path, placement: str) -> None:
    tmp_path = launched / placement
    ranks = ranks_of(tmp_path)
    scored = {p.name: p.read_text().split("\n")[:-1] for p in tmp_path.glob("scored.*")}
    if placement == "main":  # rank 0 alone, every sample of both ranks, once per iteration
        assert scored == {"scored.0": ["0 12"] * 4}
    else:
        assert scored == {"scored.0": ["0 6"] * 4, "scored.1": ["1 6"] * 4}
    for seen in ranks:
        for it in seen:
            outputs = [s["output"] for s in it["mine"]]
            assert len(outputs) == 6
            assert [s["toxicity"] for s in it["mine"]] == pytest.approx(vowel_share([], outputs), abs=1e-12)
    # the two ranks' samples differ (else "its own" proves nothing), their statistics do not
    assert [s["output"] for s in ranks[0][0]["mine"]] != [s["output"] for s in ranks[1][0]["mine"]]
    for it0, it1 in zip(*ranks):
        assert it0["stats"] == it1["stats"]
        assert {"var", "reward_mean", "reward_std", "toxicity_mean", "cvar_bonus_mean", "quality_mean",
                "similarity_mean", "attack_success_rate", "distinct_attacks", "advantage_std"} <= set(it0["stats"])
    rows = [json.loads(x) for x in (tmp_path / "run" / "attacks.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 12 and [r["step"] for r in rows[::12]] == [1, 2, 3, 4]
    assert [r["toxicity"] for r in rows] == pytest.approx(vowel_share([], [r["output"] for r in rows]), abs=1e-12)
    mine = [s for it0, it1 in zip(*ranks) for s in it0["mine"] + it1["mine"]]  # rank order = global order
    assert [r["attack"] for r in rows] == [s["attack"] for s in mine]
    assert [r["advantage"] for r in rows] == pytest.approx([s["advantage"] for s in mine], abs=1e-6)


def test_two_processes_equal_one(micro_model: Path, launched: Path, tmp_path: Path) -> None:
    one = run(micro_model, tmp_path / "one", 1, *GREEDY)[0]
    two = ranks_of(launched / "two")[0]
    for a, b in zip(one, two):
        for key in ("var", "reward_mean", "reward_std", "advantage_std", "toxicity_mean", "similarity_mean"):
            assert a["stats"][key] == pytest.approx(b["stats"][key], abs=1e-9), key
    la, lb = (json.loads((d / "losses.json").read_text()) for d in (tmp_path / "one", launched / "two"))
    assert la == pytest.approx(lb, abs=1e-6)
    wa, wb = (load_file(str(d / "run" / "final" / "model.safetensors")) for d in (tmp_path / "one", launched / "two"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5


def test_resume_is_exact(launched: Path) -> None:
    report = json.loads((launched / "resume" / "report.json").read_text())
    assert len(report["straight"]) == 4 and report["resumed"] == pytest.approx(report["straight"][2:], abs=1e-9)
    assert report["weights"] == 0.0 and report["attacks_equal"] and report["top_equal"]


def test_a_failing_scorer_on_rank_0_stops_every_rank(micro_model: Path, tmp_path: Path) -> None:
    """placement main: rank 0's error reaches rank 1 (which would otherwise wait for its scores forever)."""
    from tests.conftest import REPO, run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "say {i}"}}\n' for i in range(8)))
    proc = run_cli(["train", str(REPO / "configs" / "redteam.yaml"), f"output_dir={tmp_path / 'run'}",
                    f"model.name_or_path={micro_model}", "model.lora=null", f"data.train={prompts}", "data.max_length=48",
                    f"redteam.target.model={micro_model}", "redteam.target.max_new_tokens=4",
                    "redteam.scorers=[{name: 'tests.plugins.redteam_parts:broken_judge'}]", "rollout.num_generations=2",
                    "rollout.max_new_tokens=4", "training.per_device_batch_size=2", "training.max_steps=1",
                    "logging.plot=false", "distributed.strategy=ddp"], nproc=2, cwd=REPO, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("the judge's server is down") == 1, proc.stderr[-3000:]  # said once, by rank 0


def test_multi_turn_each_rank_trains_on_its_own_conversations(launched: Path) -> None:
    """``redteam.turns: 2`` (the micro target reading each conversation through its chat template): rank 0 alone
    scores every answer of both ranks (12 conversations x 2 turns), each rank trains on the toxicity of ITS OWN
    conversations at their riskiest turn, and every statistic is the same on both ranks."""
    tmp_path = launched / "multi_turn"
    ranks = ranks_of(tmp_path)
    scored = {p.name: p.read_text().split("\n")[:-1] for p in tmp_path.glob("scored.*")}
    assert scored == {"scored.0": ["0 24"] * 4}
    for seen in ranks:
        for it in seen:
            assert [s["toxicity"] for s in it["mine"]] == pytest.approx(vowel_share([], [s["output"] for s in it["mine"]]),
                                                                        abs=1e-12)
    assert [s["attack"] for s in ranks[0][0]["mine"]] != [s["attack"] for s in ranks[1][0]["mine"]]
    for it0, it1 in zip(*ranks):
        assert it0["stats"] == it1["stats"]
        assert {"var", "reward_mean", "reward_std", "advantage_std", "turn_scored_mean"} <= set(it0["stats"])
    rows = [json.loads(x) for x in (tmp_path / "run" / "attacks.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 12 and all(len(r["turns"]) == 2 for r in rows)
    for r in rows:
        per_turn = vowel_share([], [t["output"] for t in r["turns"]])
        assert [t["toxicity"] for t in r["turns"]] == pytest.approx(per_turn, abs=1e-12)
        assert r["toxicity"] == pytest.approx(max(per_turn), abs=1e-12)
    mine = [s for it0, it1 in zip(*ranks) for s in it0["mine"] + it1["mine"]]  # rank order = global order
    assert [r["attack"] for r in rows] == [s["attack"] for s in mine]
    assert [r["advantage"] for r in rows] == pytest.approx([s["advantage"] for s in mine], abs=1e-6)
