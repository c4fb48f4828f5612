"""The calculator tool task learns (issue 48, 4a): from an SFT warm start on noisy tool-use demonstrations
(``configs/sft_calculator.yaml``: 2000 rows of 2-digit products through the short ``calc`` call, half of them
mistyping the expression, guessing without the tool, or breaking the call), multi-turn GRPO
(``configs/grpo_agent_calculator.yaml``, as shipped but for the seed: 20 iterations of 4 questions x 8
trajectories, temperature 0.7, lr 1e-4) raises the tool-call validity and cuts the malformed calls, while the
sampled success holds and the greedy held-out success does not collapse. It does NOT raise the greedy held-out
success (measured below): what GRPO learns here in 20 iterations is to write the call well.

Measured (one warm start: SFT 400 steps, nll 0.13, greedy held-out success 0.73 on the 64 held-out questions;
GRPO seeds 0 / 1 / 2; first -> last 5-iteration window; busy 2-core machine, 2026-11-28):

  | seed | tool-call validity | malformed calls / trajectory | sampled success | greedy held-out (0, 10, 20) |
  |---|---|---|---|---|
  | 0 | 0.845 -> 0.937 | 0.144 -> 0.050 | 0.206 -> 0.250 | 0.73, 0.66, 0.73 |
  | 1 | 0.834 -> 0.897 | 0.150 -> 0.094 | 0.231 -> 0.275 | 0.73, 0.64, 0.69 |
  | 2 | 0.885 -> 0.968 | 0.113 -> 0.031 | 0.231 -> 0.231 | 0.73, 0.55, 0.55 |

Turns per trajectory 1.96-1.98 throughout (the warm start already calls the tool). From the same warm start at
temperature 1.0 and lr 3e-4 (the settings before): sampled success 0.02-0.05 at the start, and GRPO undid the
warm start (greedy held-out 0.73 -> 0.0 / 0.02 in 20 iterations, seeds 0 / 1). With SFT 200 steps no answer is
right (greedy 0.0); at 300 (other demonstrations) greedy 0.88 and sampled 0.03 at temperature 1.
Tried on 2026-11-29 to make the greedy held-out success rise (seed 0 unless said; greedy held-out at the steps
given), with the input embeddings and block 0 frozen (``model.freeze``: what lets ``benchmarks/learn_addition.py``'s
GRPO learn on the same micro Llama, see ``benchmarks/probe_sharpness.py``): lr 1e-3 collapses (0.73 -> 0.0 at 10);
lr 3e-4 0.73 -> 0.61 at 10; lr 3e-4 with 10 warm-up steps 0.73 / 0.56 / 0.75 at 0 / 20 / 40; lr 1e-4 for 60
iterations, seeds 0 / 1 / 2: 0.73 -> (20, 40, 60) 0.75, 0.77, 0.73 / 0.75, 0.75, 0.70 / 0.73, 0.78, 0.77. The
training reward rises (first 10 iterations 0.21, last 10 0.32, seed 0 at 40) but the held-out greedy success
moves by at most 3 of the 64 questions either way: not a rise that can be asserted.
Thresholds (seed 0): validity rises (min measured rise 0.063) to >= 0.85 (min 0.897), malformed calls fall (min
drop 0.056), sampled success of the last window >= 0.15 (min 0.225), greedy held-out at the end >= 0.4 (min
0.55). Cost: SFT 57 CPU-seconds, GRPO 22-25 (one thread each; about 100 s on idle cores with start-ups).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok, run_cli

pytestmark = pytest.mark.slow(seconds=120)

QUIET = ["logging.report_to=[jsonl]", "logging.plot=false"]


@pytest.fixture(scope="session")
def calculator_warm(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe's warm start: ``configs/sft_calculator.yaml`` on the micro Llama (built once per session)."""
    out = tmp_path_factory.mktemp("calculator-warm") / "sft"
    assert_ok(run_cli(["train", str(REPO / "configs" / "sft_calculator.yaml"), f"model.name_or_path={micro_model}",
                       f"output_dir={out}", "checkpoint.save_steps=null", *QUIET], timeout=900))
    return out / "final"


def metrics(run: Path) -> tuple[list[dict], list[float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]


def window(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.parametrize("seed", [0])
def test_tool_use_rises(calculator_warm: Path, tmp_path: Path, seed: int) -> None:
    run = tmp_path / "grpo"
    assert_ok(run_cli(["train", str(REPO / "configs" / "grpo_agent_calculator.yaml"),
                       f"model.name_or_path={calculator_warm}", f"output_dir={run}", f"training.seed={seed}",
                       "checkpoint.save_final=false", "logging.logging_steps=1", *QUIET], cwd=REPO, timeout=900))
    its, held_out = metrics(run)
    assert len(its) == 20 and len(held_out) == 3  # before, at 10, at the end
    first, last = its[:5], its[-5:]
    valid = window(first, "agent/tool_valid"), window(last, "agent/tool_valid")
    malformed = window(first, "agent/tool_malformed"), window(last, "agent/tool_malformed")
    assert valid[1] > valid[0] and valid[1] >= 0.85, valid
    assert malformed[1] < malformed[0], malformed
    assert window(last, "reward_mean") >= 0.15, [r["reward_mean"] for r in its]
    assert held_out[0] >= 0.5 and held_out[-1] >= 0.4, held_out  # the warm start answers; GRPO keeps it
