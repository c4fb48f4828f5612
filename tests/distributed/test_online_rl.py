"""Online RL across ranks (worker: tests/distributed/workers/online_rl.py): advantages from gathered
rewards equal the one-process computation when groups span ranks; ``placement: main`` returns each rank
its own scores; whitening statistics (over the scorable tokens only), reward statistics and lambda are
identical on every rank; a resumed online run continues exactly (same losses, same final weights of every
role)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_script

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parent / "workers" / "online_rl.py"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def test_statistics_across_ranks(cases_root: Path) -> None:
    tmp_path = cases_root / "stats"  # the worker's stats mode, run first in the 2-process cases' launch
    r0, r1 = (json.loads((tmp_path / f"stats_{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["gathered_equal"]
        assert r["grpo"] == r["rloo"] == r["dr_grpo"] == 0.0  # the split group gives the one-process advantages
        assert r["placement_main_equal_local"]  # rank 0 scored everything, each rank got ITS OWN scores
    assert r0["local_total"] == [1.0, 2.0, 3.0]  # length (1..3 words) + 2 x exact_match (no match)
    assert r1["local_total"] == [6.0, 5.0, 6.0]  # 4 words + 2 x match; 5; 6
    # whitening statistics: the same on both ranks, over the scorable tokens only (rank 1's last sample is
    # unscorable): rank 0 (0, 0), (1, -1), (2, -2); rank 1 (1, 2), (2, 1) -> mean 6/10, var 20/10 - 0.36
    assert r0["whiten_stats"] == r1["whiten_stats"]
    assert r0["whiten_stats"] == pytest.approx([0.6, 2.0 - 0.36], abs=1e-12)
    whitened = [v for r in (r0, r1) for s in r["whitened"] for v in s]
    assert len(whitened) == 10
    assert abs(sum(whitened)) < 1e-9 and abs(sum(v * v for v in whitened) / len(whitened) - 1) < 1e-6
    assert r0["unscorable"] == [] and r1["unscorable"] == [[0.0, 0.0]]  # advantage 0 after whitening


CASES = {"ppo_lag-ddp": ("ppo_lag", "ddp", 2, []), "grpo-fsdp": ("grpo", "fsdp", 2, []),
         "grpo-zero3": ("grpo", "deepspeed", 2, ["distributed.deepspeed.zero_stage=3"]),
         "rloo-single": ("rloo", "single", 1, [])}


@pytest.fixture(scope="module")
def cases_root(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case's runs, in ROOT/CASE: one launch per process count (the 2-process cases one after another in the
    same process group: a launch's start-up costs more than a case); the 2-process launch first writes the
    statistics checks of test_statistics_across_ranks into ROOT/stats."""
    root = tmp_path_factory.mktemp("online_resume")
    for nproc in sorted({c[2] for c in CASES.values()}):
        cases = {name: [algo, strategy, extra] for name, (algo, strategy, n, extra) in CASES.items()
                 if n == nproc and (strategy != "deepspeed" or HAS_DEEPSPEED)}
        assert_ok(run_script(WORKER, nproc=nproc, timeout=900,
                             args=[str(micro_model), str(root), "stats+cases" if nproc == 2 else "cases",
                                   json.dumps(cases)]))
    return root


@pytest.mark.slow(seconds=60)  # the fixture (every case: 55 s at a load average of ~3.6), at the first case
@pytest.mark.parametrize("case", list(CASES))
def test_online_resume_is_exact_and_ranks_agree(cases_root: Path, case: str) -> None:
    algo, strategy, nproc, _ = CASES[case]
    if strategy == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    tmp_path = cases_root / case
    report = json.loads((tmp_path / "report.json").read_text())
    straight, resumed = report["straight"], report["resumed"]
    assert len(straight) == 8 and len(resumed) == 4
    assert max(abs(a - b) for a, b in zip(straight[4:], resumed)) <= 1e-6, (straight, resumed)
    assert report["weights"] and max(report["weights"].values()) <= 1e-6, report["weights"]
    expected = {"final", "final_value", "final_cost_value"} if algo == "ppo_lag" else {"final"}
    assert set(report["weights"]) == expected
    rows = report["logged"]
    assert all("reward_mean" in r and "step" in r for r in rows if "loss" in r)
    if nproc == 2:  # every statistic that steers training is the same on both ranks
        for run in ("straight", "resumed"):
            a, b = (json.loads((tmp_path / f"ranks_{run}_{r}.json").read_text()) for r in (0, 1))
            assert a == b and len(a) == (4 if run == "straight" else 2)
    if algo == "ppo_lag":
        lam = [r["lambda"] for r in rows if "lambda" in r]
        assert lam[0] > 1.0  # the length cost (~3 words) exceeds the threshold (2): lambda rises
