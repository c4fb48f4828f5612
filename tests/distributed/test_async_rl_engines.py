"""``rollout.placement: separate`` beyond full weights on single / ddp (gloo on CPU, k = 0, so synchronous):

* a LoRA policy: 1 trainer + 1 generator give EXACTLY the numbers of 1 colocated process (losses, rewards,
  gradient norms, the final adapters), and each version pushes the adapters alone (``async/weight_sync_bytes`` is
  4 bytes per trainable parameter; the frozen base is loaded by the generator and checked once by checksum);
* FSDP2, DeepSpeed ZeRO-3 and ZeRO-2 trainers: 2 trainers + 1 generator (3 processes; the weights gathered over
  the trainers' group bucket by bucket, broadcast by trainer rank 0; the runs checkpoint twice, so DeepSpeed's and
  DCP's collectives run on the trainers' group) against the colocated run of the same strategy with 2 processes:
  EXACTLY equal (losses, rewards, gradient norms, final weights; measured Δ = 0 for FSDP2 and ZeRO-3, tighter than
  the 1e-5 tests/distributed/test_fsdp.py and test_deepspeed.py hold them to against one process / ddp, since
  both runs take the same steps of the same engine on the same samples);
* the weight path alone (workers/weight_sync.py): sharded weights through tiny buckets, and the base check.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import assert_ok, run_cli, run_script
from tests.distributed.runs import final_weights, max_delta
from tests.distributed.test_async_rl import _config, _rows

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"
KEYS = ("loss", "reward_mean", "grad_norm", "completion_length", "advantage_std")


def _numbers(model_dir: Path) -> int:
    """How many numbers a full-weight version sends: the model's parameters and buffers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return sum(t.numel() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.slow(seconds=60)
def test_lora_separate_k0_equals_colocated_and_pushes_the_adapters_only(micro_model: Path, tmp_path: Path) -> None:
    cfg = _config(micro_model, tmp_path)
    common = ["train", str(cfg), "distributed.strategy=single", "model.lora={r: 4, alpha: 8, dropout: 0.0}"]
    assert_ok(run_cli([*common, f"output_dir={tmp_path / 'colocated'}"], timeout=300))
    assert_ok(run_cli([*common, f"output_dir={tmp_path / 'k0'}", "rollout.placement=separate"], nproc=2, timeout=300))
    colocated, k0 = _rows(tmp_path / "colocated"), _rows(tmp_path / "k0")
    assert len(colocated) == len(k0) == 4
    adapters = load_file(str(tmp_path / "k0" / "final" / "adapter_model.safetensors"))
    assert adapters and all("lora_" in name for name in adapters)
    for a, b in zip(colocated, k0):
        for key in KEYS:
            assert a[key] == b[key], (key, a[key], b[key])
        assert b["staleness/0"] == 8 and b["staleness/dropped"] == 0
        assert b["async/weight_sync_bytes"] == 4 * sum(t.numel() for t in adapters.values())
    base = sum(t.numel() for t in load_file(str(micro_model / "model.safetensors")).values())
    assert k0[0]["async/weight_sync_bytes"] < 4 * base / 10  # far less than the model: the base never travels
    final = load_file(str(tmp_path / "colocated" / "final" / "adapter_model.safetensors"))
    assert max_delta(final, adapters) == 0.0


SHARDED = {"fsdp": ["distributed.strategy=fsdp"],
           "zero3": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=3"],
           "zero2": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=2"]}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def sharded_runs(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT/STRATEGY/{colocated,k0} for each of SHARDED, one run after another in a launch (workers/train_many.py:
    a launch's start-up costs more than these runs): the colocated runs in ONE 2-process launch, the separate ones
    in 3-process launches of at most one DeepSpeed run each (a second DeepSpeed trainers' group in the same
    process fails: deepspeed_group.use_trainers_group wraps DeepSpeed's collectives again, and the wrapper it
    finds has no ``group`` parameter)."""
    root = tmp_path_factory.mktemp("sharded_async")
    cfg = _config(micro_model, root)
    names = [n for n, s in SHARDED.items() if HAS_DEEPSPEED or "deepspeed" not in s[0]]
    separate = [["fsdp", "zero3"], ["zero2"]] if HAS_DEEPSPEED else [["fsdp"]]
    for nproc, run, groups in ((2, "colocated", [names]), (3, "k0", separate)):
        extra = ["rollout.placement=separate"] if run == "k0" else []
        for group in groups:
            args = [a for n in group for a in [str(cfg), *SHARDED[n], f"output_dir={root / n / run}", *extra]]
            assert_ok(run_script(WORKERS / "train_many.py", nproc=nproc, args=args, timeout=600))
    return root


@pytest.mark.slow(seconds=120)  # the fixture (its 3 launches: 113 s at a load average of ~5), at the first case
@pytest.mark.parametrize("strategy", list(SHARDED))
def test_sharded_trainers_separate_k0_equal_colocated(micro_model: Path, sharded_runs: Path, strategy: str) -> None:
    if "deepspeed" in SHARDED[strategy][0] and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    tmp_path = sharded_runs / strategy
    colocated, k0 = _rows(tmp_path / "colocated"), _rows(tmp_path / "k0")
    assert len(colocated) == len(k0) == 4
    n_weights = _numbers(micro_model)
    for a, b in zip(colocated, k0):
        assert b["staleness/0"] == 16 and b["staleness/dropped"] == 0
        for key in KEYS:
            assert b[key] == a[key], (key, a[key], b[key])
        assert b["async/weight_sync_bytes"] == 4 * n_weights
    assert max_delta(final_weights(tmp_path / "colocated"), final_weights(tmp_path / "k0")) == 0.0


def test_weights_gathered_in_buckets_and_the_base_check() -> None:
    """workers/weight_sync.py (3 processes, a few seconds): FSDP2-sharded weights reach the generator whole through
    tiny buckets; a generator base that differs in one number is refused in one line."""
    from tests.conftest import run_script

    proc = run_script(Path(__file__).parent / "workers" / "weight_sync.py", nproc=3, timeout=120)
    assert_ok(proc)
    # trainer rank 0 sent 4 bytes for each of the 59 numbers: (6 x 5 + 5) + (5 x 3 + 3) + (3 + 3)
    # the three processes share one stdout: their lines may interleave ("OKOK 0 236"), so read the reports as tokens
    assert sorted(re.findall(r"OK (\d+) (\d+)", proc.stdout)) == [("0", "236"), ("1", "0"), ("2", "0")]
