"""Preference learning really learns (slow; the micro model, one thread, on 2 CPU cores: about 1.5 min).

- The seed workflow: a Helpful-RM (reward_model, helpful pairs) and a Harmless-RM (cost_model,
  safety pairs, C > 0 = unsafe) from the SAME PKU-SafeRLHF-style file reach >= 95% held-out
  pairwise accuracy (the cost model also >= 95% sign accuracy).
- A reward model on the shipped task preferences (pref_train.jsonl) learns what a 2-layer scalar
  head can: the ``upper`` pairs perfectly; ``add`` needs the sum to be verified, which stays near
  chance at this size, and ``reverse`` in between (see the numbers printed below).
- DPO from an SFT warm start (SFT of the micro model, trained here with the SFT algorithm): held-out
  implicit-reward accuracy from 50% (policy == reference: every margin is 0) to >= 70% on all pairs
  and >= 85% on the pairs that need no arithmetic (``upper``, ``reverse``). The ``add`` pairs stay
  near chance unless the SFT start happened to learn sums (seed 3 below), which is why the overall
  accuracy sits near 0.83 = (85 + 51 + 64/2) / 200 on most seeds. With the RPO term
  (``dpo.rpo_alpha=1``) the chosen answers keep a higher log-probability than with plain DPO.
- KTO (the pairs unpaired) and ORPO from the same SFT start with DPO's settings: implicit-reward accuracy
  against the start well above chance (KTO about as high as DPO), KTO's desirable rewards above its
  undesirable ones, ORPO's chosen NLL falling (the table above ``KTO_MIN``).
- The judge's accuracy on greedy answers to held-out prompts moves by a few points either way,
  depending on the seed (DPO on these offline pairs also pushes down the *copy* of the wrong sum in
  "The answer is W", a behaviour the chosen answers need too; RPO helps when the SFT start is weak,
  not when it is already good): only "no collapse" (at most 0.15 below the SFT start) is asserted.

Measured (this machine, 2 shared cores; SFT seed / DPO seed via ``training.seed``; ``nosum`` =
implicit accuracy on the upper+reverse pairs, ``judge`` = greedy accuracy on 150 prompts, W/L =
prompts won/lost against the SFT start; SFT 20-30 s, each DPO run 7-13 s):

    seeds   SFT   | DPO: implicit nosum judge  W/L  | DPO+RPO: implicit nosum judge  W/L
    0/0    0.300  |      0.840   0.993 0.367  14/4  |          0.855   1.000 0.407  18/2
    1/1    0.393  |      0.830   0.985 0.407   4/2  |          0.840   0.993 0.447   8/0
    2/2    0.553  |      0.850   1.000 0.553   3/3  |          0.830   0.978 0.560   6/5
    3/3    0.347  |      0.940   1.000 0.327   8/11 |          0.905   0.971 0.427  16/4
    4/4    0.300  |      0.815   0.978 0.280   4/7  |          0.830   0.978 0.347   8/1
    5/5    0.453  |      0.830   0.985 0.473   9/6  |          0.835   0.978 0.593  21/0
    6/6    0.540  |      0.825   0.985 0.507   5/10 |          0.845   0.971 0.527   5/7
    7/7    0.400  |      0.830   0.985 0.427  10/6  |          0.820   0.993 0.460  13/4
    8/8    0.593  |      0.825   0.993 0.560   0/5  |          0.830   0.985 0.540   3/11
    9/9    0.480  |      0.855   0.993 0.493   4/2  |          0.860   1.000 0.527   7/0
    10/10  0.307  |      0.805   0.978 0.327   6/3  |          0.845   0.985 0.360  13/5
    11/11  0.307  |      0.805   0.926 0.340  13/8  |          0.785   0.912 0.407  18/3
    0/100  0.300  |      0.875   1.000 0.393  16/2  |          0.865   0.993 0.393  18/4
    2/102  0.553  |      0.850   1.000 0.553   3/3  |          0.850   1.000 0.580   6/2
    6/106  0.540  |      0.825   0.993 0.480   5/14 |          0.835   0.963 0.500   4/10

  Minimum implicit 0.785 (asserted >= 0.70), nosum 0.912 (>= 0.85); judge change -0.06 .. +0.14
  (>= -0.15); RPO's chosen log-prob above plain DPO's on every row (by 0.12 .. 0.87). Reward models,
  seeds 0-9: helpful 1.000 and harmless 0.990-1.000 (sign 1.000) at 200 steps (harmless 0.965-0.990
  at 100, hence 200); task RM ``upper`` 1.000, all pairs 0.755-0.800 (asserted >= 0.68).

Every number is reproducible in a fresh process: each training, evaluation and generation runs
under ``pinned()`` (one thread, seeded RNGs), also the session-scoped SFT warm start, which pytest
sets up before any module-scoped fixture when this test runs alone. ``ALIGNKIT_LEARN_SEED=N`` sets
``training.seed`` of every run (SFT and DPO) to re-measure a row. Run with ``-s`` to see the numbers.
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from alignkit.config import load_config
from alignkit.data.io import read_rows
from alignkit.data.judges import judge_correct
from alignkit.data.synth import write_rows
from alignkit.resources import resource_path
from tests.conftest import REPO

pytestmark = pytest.mark.slow

N_JUDGE = 150  # held-out prompts answered greedily
SEED = int(os.environ.get("ALIGNKIT_LEARN_SEED", "0"))  # training.seed of every run (docstring table)


@contextmanager
def pinned() -> Iterator[None]:
    """The process-wide state these numbers depend on, fixed for a step and restored after, so they
    do not depend on what ran before in the process or on the fixture order. One intra-op thread:
    the same floating-point reduction order whatever the machine's core count (these runs are long
    enough for that noise to change which answers come out right; measured: SFT at 2 threads ends
    with other weights and another greedy accuracy) and no oversubscription on shared cores.
    float32 default dtype; subnormals flushed, as ``run_train`` does on CPU (for the whole process:
    torch has no getter to restore it); every RNG seeded."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.set_flush_denormal(True)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)


@pytest.fixture(autouse=True)
def pinned_test() -> Iterator[None]:
    with pinned():
        yield


def train(config: Path | str, overrides: list[str]):
    from alignkit.train.runner import run_train

    start = time.perf_counter()
    with pinned():  # also for the session-scoped warm start, set up before any test-level fixture
        result = run_train(load_config(config, [*overrides, f"training.seed={SEED}"]))
    return result, time.perf_counter() - start


@pytest.fixture(scope="session")
def sft_micro(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The micro model after SFT on the shipped tasks (chat format): 30-60% of the greedy answers
    right depending on the seed, sums rarely (the table in the module docstring)."""
    out = tmp_path_factory.mktemp("sft_warm_start")
    _, secs = train(resource_path("demo_sft.yaml"), [
        f"model.name_or_path={micro_model}", f"output_dir={out}", "data.eval=[]", "training.max_steps=800",
        "training.learning_rate=5e-3", "training.lr_scheduler=constant", "training.per_device_batch_size=32",
        "logging.report_to=[jsonl]", "logging.logging_steps=100",
    ])
    print(f"\n[sft warm start] 800 steps in {secs:.0f}s")
    return out / "final"


def judge_accuracy(model_dir: Path) -> tuple[float, list[bool]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignkit.rollout.generate import generate

    rows = [r.data for r in read_rows("builtin:sft_eval.jsonl")][:N_JUDGE]
    prompts = [r["messages"][0]["content"] for r in rows]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    answers = generate(model, tok, prompts, max_new_tokens=24, batch_size=50)
    right = [judge_correct(p, a) for p, a in zip(prompts, answers)]
    return sum(right) / len(right), right


def rm_overrides(model: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.name_or_path={model}", f"output_dir={out}", "data.max_length=128", "training.eval_batch_size=50",
            "training.learning_rate=2e-3", "training.max_steps=200", "training.eval_steps=1000",
            "logging.report_to=[jsonl]", *extra]


def test_helpful_and_harmless_rms_from_one_pku_file(micro_model: Path, tmp_path: Path) -> None:
    helpful, secs_h = train(REPO / "configs" / "rm_helpful.yaml", rm_overrides(micro_model, tmp_path / "helpful"))
    harmless, secs_c = train(REPO / "configs" / "rm_harmless.yaml", rm_overrides(micro_model, tmp_path / "harmless"))
    h, c = helpful.eval_metrics, harmless.eval_metrics
    print(f"\n[helpful RM] held-out accuracy {h['accuracy']:.3f} margin {h['margin']:.2f} ({secs_h:.0f}s)"
          f"\n[harmless CM] held-out accuracy {c['accuracy']:.3f} sign accuracy {c['sign_accuracy']:.3f} "
          f"margin {c['margin']:.2f} ({secs_c:.0f}s)")
    assert h["accuracy"] >= 0.95
    assert c["accuracy"] >= 0.95 and c["sign_accuracy"] >= 0.95


def test_reward_model_on_task_preferences(micro_model: Path, tmp_path: Path) -> None:
    from alignkit.cli.score_command import score_rows
    from alignkit.models.scalar import load_scorer

    out = tmp_path / "rm_pref"
    result, secs = train(REPO / "configs" / "rm_helpful.yaml", rm_overrides(
        micro_model, out, "data.train=builtin:pref_train.jsonl", "data.eval=builtin:pref_eval.jsonl",
        "training.max_steps=150"))
    scored = score_rows(*load_scorer(out / "final"), read_rows("builtin:pref_eval.jsonl"), max_length=128)
    per: dict[str, list[bool]] = {}
    for r in scored:
        per.setdefault(r["task"], []).append(r["chosen_score"] > r["rejected_score"])
    by_task = {k: sum(v) / len(v) for k, v in sorted(per.items())}
    print(f"\n[task RM] held-out accuracy {result.eval_metrics['accuracy']:.3f} per task "
          f"{ {k: round(v, 3) for k, v in by_task.items()} } ({secs:.0f}s)")
    assert by_task["upper"] >= 0.95
    assert result.eval_metrics["accuracy"] >= 0.68


def dpo_overrides(sft: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.name_or_path={sft}", f"output_dir={out}", "data.chat_template=true", "data.max_length=96",
            "dpo.beta=0.1", "dpo.precompute_ref_logps=true", "training.per_device_batch_size=16",
            "training.learning_rate=3e-4", "training.max_steps=150", "training.eval_steps=1000",
            "training.eval_batch_size=50", "logging.report_to=[jsonl]", *extra]


def implicit_accuracy(sft: Path, model: Path, pairs: list[dict], path: Path) -> float:
    """Held-out implicit-reward accuracy of ``model`` against ``sft`` on ``pairs`` only."""
    from alignkit.cli.eval_command import run_eval

    write_rows(pairs, path)
    cfg = load_config(REPO / "configs" / "dpo.yaml", dpo_overrides(
        sft, path.parent / "eval_subset", f"data.eval={path}", "dpo.precompute_ref_logps=false"))
    return run_eval(cfg, model_dir=str(model))["rewards/accuracy"]


def test_dpo_learns_preferences_from_the_sft_start(sft_micro: Path, tmp_path: Path) -> None:
    from alignkit.cli.eval_command import run_eval

    # the start against itself, the reference computed in the same batch: every margin is exactly 0
    start = dpo_overrides(sft_micro, tmp_path / "start", "dpo.precompute_ref_logps=false")
    before = run_eval(load_config(REPO / "configs" / "dpo.yaml", start))
    judge_before, right_before = judge_accuracy(sft_micro)
    pairs = [r.data for r in read_rows("builtin:pref_eval.jsonl")]
    no_sums = [p for p in pairs if p["task"] != "add"]
    sums = [p for p in pairs if p["task"] == "add"]
    report = {"implicit_before": before["rewards/accuracy"], "judge_before": judge_before}
    for name, extra in (("dpo", []), ("dpo+rpo", ["dpo.rpo_alpha=1.0"])):
        result, secs = train(REPO / "configs" / "dpo.yaml", dpo_overrides(sft_micro, tmp_path / name, *extra))
        final = tmp_path / name / "final"
        judge, right = judge_accuracy(final)
        wins = sum(a and not b for a, b in zip(right, right_before))
        losses = sum(b and not a for a, b in zip(right, right_before))
        ev = result.eval_metrics
        report[name] = {"implicit": ev["rewards/accuracy"], "margin": ev["rewards/margin"], "kl": ev["kl"],
                        "logps_chosen": ev["logps/chosen"],
                        "implicit_no_sums": implicit_accuracy(sft_micro, final, no_sums, tmp_path / "no_sums.jsonl"),
                        "implicit_sums": implicit_accuracy(sft_micro, final, sums, tmp_path / "sums.jsonl"),
                        "judge": judge, "wins": wins, "losses": losses, "seconds": secs}
        r = report[name]
        print(f"\n[{name}] held-out implicit-reward accuracy {before['rewards/accuracy']:.3f} -> "
              f"{r['implicit']:.3f} (upper+reverse {r['implicit_no_sums']:.3f}, add {r['implicit_sums']:.3f}; "
              f"margin {r['margin']:.2f}, kl {r['kl']:.3f}, chosen log-prob {r['logps_chosen']:.2f}); judge accuracy "
              f"{judge_before:.3f} -> {judge:.3f} ({wins} prompts won, {losses} lost of {N_JUDGE}); {secs:.0f}s")
    (tmp_path / "numbers.json").write_text(json.dumps(report, indent=1))
    assert abs(before["rewards/accuracy"] - 0.5) < 0.05
    for name in ("dpo", "dpo+rpo"):  # thresholds: the module docstring's table, minimum minus a margin
        r = report[name]
        assert r["implicit"] >= 0.70, (name, r)
        assert r["implicit_no_sums"] >= 0.85, (name, r)
        assert torch.isfinite(torch.tensor(r["kl"]))
        assert r["judge"] >= judge_before - 0.15, (name, report)  # the policy still answers
    assert report["dpo+rpo"]["logps_chosen"] > report["dpo"]["logps_chosen"], report


#: KTO and ORPO from the SFT start with DPO's settings (recipe defaults: kto.beta 0.1, orpo.beta 0.1), seeds
#: 0-2 (``ALIGNKIT_LEARN_SEED``); implicit = held-out implicit-reward accuracy against the SFT start on all 200
#: pairs / the 136 upper+reverse pairs; KTO margin = eval rewards/chosen - rewards/rejected (0 at the start);
#: ORPO nll = the chosen answers' held-out per-token NLL, start -> end:
#:
#:   seed | KTO implicit nosum margin | ORPO implicit nosum nll
#:   0    |     0.840   0.971  0.736  |      0.715   0.757  0.325 -> 0.228
#:   1    |     0.860   0.978  0.558  |      0.625   0.691  0.381 -> 0.301
#:   2    |     0.795   0.934  0.750  |      0.705   0.787  0.310 -> 0.228
#:
#: ORPO moves less than DPO and KTO here: the SFT start already ranks 83-88% of the pairs right by mean log-prob,
#: and at this size ORPO is mostly its SFT term (orpo.beta=1: 0.740 / 0.809 and 0.650 / 0.743 on seeds 0, 1). Its
#: odds-ratio term is pinned by the hand-computed and TRL cross-check tests instead.
ORPO_LEARN: list[str] = []
KTO_MIN = (0.72, 0.86)  # (implicit, nosum): minimum measured 0.795 / 0.934, minus a margin
ORPO_MIN = (0.57, 0.63)  # minimum measured 0.625 / 0.691, minus a margin


def test_kto_and_orpo_learn_preferences_from_the_sft_start(sft_micro: Path, tmp_path: Path) -> None:
    """KTO (the task's pairs unpaired: chosen desirable, rejected undesirable) and ORPO (no reference) from
    the SFT start, with DPO's settings: held-out implicit-reward accuracy against the SFT start (the
    measure DPO is held to) well above chance (0.5), and each algorithm's own signal moves the right way
    (KTO: desirable completions' reward above the undesirable ones'; ORPO: the chosen answers' NLL falls).
    Thresholds: the table above, minimum minus a margin."""
    from alignkit.cli.eval_command import run_eval

    pairs = [r.data for r in read_rows("builtin:pref_eval.jsonl")]
    no_sums = [p for p in pairs if p["task"] != "add"]
    report = {}
    for name, extra in (("kto", []), ("orpo", ORPO_LEARN)):
        config = REPO / "configs" / f"{name}.yaml"
        overrides = [o for o in dpo_overrides(sft_micro, tmp_path / name, *extra) if not o.startswith("dpo.")]
        start = run_eval(load_config(config, [*overrides, f"output_dir={tmp_path / name}_start"]))
        result, secs = train(config, overrides)
        final = tmp_path / name / "final"
        report[name] = {"start": start, "end": result.eval_metrics, "seconds": secs,
                        "implicit": implicit_accuracy(sft_micro, final, pairs, tmp_path / "all.jsonl"),
                        "implicit_no_sums": implicit_accuracy(sft_micro, final, no_sums, tmp_path / "no_sums.jsonl")}
        r = report[name]
        print(f"\n[{name}] held-out implicit-reward accuracy vs the SFT start {r['implicit']:.3f} (upper+reverse "
              f"{r['implicit_no_sums']:.3f}); eval {({k: round(v, 3) for k, v in r['end'].items()})}; {secs:.0f}s")
    (tmp_path / "numbers.json").write_text(json.dumps(report, indent=1))
    kto, orpo = report["kto"], report["orpo"]
    assert kto["implicit"] >= KTO_MIN[0] and kto["implicit_no_sums"] >= KTO_MIN[1], kto
    assert kto["end"]["rewards/chosen"] - kto["end"]["rewards/rejected"] > 0.2, kto  # 0 at the start
    assert orpo["implicit"] >= ORPO_MIN[0] and orpo["implicit_no_sums"] >= ORPO_MIN[1], orpo
    assert orpo["end"]["nll"] < orpo["start"]["nll"] - 0.05, orpo

