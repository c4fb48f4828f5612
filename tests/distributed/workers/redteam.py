"""Red-team RL across ranks, through the real runner and online loop (tests/distributed/test_redteam_distributed.py).

``run``: one run (``placement`` main or local); every rank writes what it saw each iteration to
``ranks_RANK.json``: the iteration statistics (VaR, reward mean / std, advantages: identical on every rank?)
and its own samples (target output, the toxicity it trained on, its advantage). The scorer logs which
process scored how many samples (``$REDTEAM_SCORE_LOG.RANK``).
``resume``: a straight run (4 iterations, checkpoint at 2) and one resumed from a copy of checkpoint-2;
rank 0 compares losses, final weights and attacks.jsonl in ``report.json``.

Usage: ``[torchrun --nproc_per_node=2] redteam.py MODEL_DIR OUT_DIR MODE [OVERRIDE ...] [:: OUT_DIR MODE ...]``:
several runs, separated by ``::``, one after another in one launch (a launch's start-up costs more than a run).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from alignkit.config import load_config
from alignkit.distributed import comm
from alignkit.distributed.comm import exit_process
from alignkit.train.runner import run_train


def config(model_dir: str, prompts: Path, out: Path, world: int, *extra: str):
    return load_config(None, [
        "algorithm=redteam", f"model.name_or_path={model_dir}", f"output_dir={out}", f"data.train={prompts}",
        "data.max_length=48", "rollout.num_generations=4", "rollout.max_new_tokens=6",
        # 12 completions per step = 3 prompts x 4: with 2 ranks the middle prompt's group spans both
        f"training.per_device_batch_size={6 // world}", "training.gradient_accumulation_steps=2",
        "training.learning_rate=1e-3", "training.max_steps=4", "training.seed=0", "checkpoint.save_steps=2",
        "logging.report_to=[jsonl]", "logging.logging_steps=1", "logging.plot=false",
        f"distributed.strategy={'ddp' if world > 1 else 'single'}",
        f"redteam.target.model={model_dir}", "redteam.target.max_new_tokens=6",
        ("redteam.scorers=[{name: 'tests.plugins.redteam_parts:vowel_share_logged'}, "
         "{name: 'tests.plugins.redteam_parts:attack_length', use: quality}]"),
        "redteam.w_cvar=0.5", "redteam.w_quality=0.5", "redteam.w_diversity=0.1", "redteam.tau=0.25", *extra,
    ])


def record_ranks(out: Path, name: str) -> None:
    """Patch the algorithm's rollout so every rank writes its statistics and its own samples."""
    from alignkit.algorithms.redteam import RedTeam

    original = getattr(RedTeam, "_unpatched_rollout", RedTeam.rollout)
    RedTeam._unpatched_rollout = original
    seen: list[dict] = []

    def spy(self, ctx):
        experience = original(self, ctx)
        stats = {k: v for k, v in experience.stats.means().items() if not k.endswith("_s") and "per_s" not in k}
        mine = [{"output": s["log"]["target"], "toxicity": s["log"]["toxicity"], "advantage": s["advantages"][0],
                 "attack": s["completion"]} for s in experience.samples]
        seen.append({"stats": stats, "mine": mine})
        (out / f"{name}_{comm.rank()}.json").write_text(json.dumps(seen))
        return experience

    RedTeam.rollout = spy


def prompts_file(out: Path) -> Path:
    from alignkit.data.synth import make_prompt_rows, write_rows

    path = out / "prompts.jsonl"
    if comm.rank() == 0:
        write_rows(make_prompt_rows(40, seed=0), path)
    comm.barrier()
    return path


def run_mode(model_dir: str, out: Path, *extra: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prompts = prompts_file(out)
    os.environ["REDTEAM_SCORE_LOG"] = str(out / "scored")
    record_ranks(out, "ranks")
    result = run_train(config(model_dir, prompts, out / "run", world, *extra))
    if comm.rank() == 0:
        (out / "losses.json").write_text(json.dumps(result.losses))


def resume_mode(model_dir: str, out: Path, *extra: str) -> None:
    from safetensors.torch import load_file

    world = int(os.environ.get("WORLD_SIZE", "1"))
    prompts = prompts_file(out)
    straight = run_train(config(model_dir, prompts, out / "straight", world, *extra))
    if comm.rank() == 0:
        shutil.copytree(out / "straight" / "checkpoint-2", out / "resumed" / "checkpoint-2")
        (out / "resumed" / "latest").write_text("checkpoint-2")
        # what a longer run wrote after its checkpoint: the resumed run must drop it
        shutil.copyfile(out / "straight" / "attacks.jsonl", out / "resumed" / "attacks.jsonl")
    comm.barrier()
    resumed = run_train(config(model_dir, prompts, out / "resumed", world, *extra, "checkpoint.resume_from=latest"))
    if comm.rank() == 0:
        a = load_file(str(out / "straight" / "final" / "model.safetensors"))
        b = load_file(str(out / "resumed" / "final" / "model.safetensors"))
        report = {"straight": straight.losses, "resumed": resumed.losses,
                  "weights": max((a[k] - b[k]).abs().max().item() for k in a),
                  "attacks_equal": (out / "straight" / "attacks.jsonl").read_text() == (out / "resumed" / "attacks.jsonl").read_text(),
                  "top_equal": (out / "straight" / "top_attacks.md").read_text() == (out / "resumed" / "top_attacks.md").read_text()}
        (out / "report.json").write_text(json.dumps(report, indent=1))


def groups(args: list[str]) -> list[list[str]]:
    """``OUT_DIR MODE [OVERRIDE ...]`` groups separated by ``::``."""
    out: list[list[str]] = [[]]
    for arg in args:
        if arg == "::":
            out.append([])
        else:
            out[-1].append(arg)
    return out


if __name__ == "__main__":
    model_dir = sys.argv[1]
    for out_dir, mode, *overrides in groups(sys.argv[2:]):  # one after another in this launch
        (run_mode if mode == "run" else resume_mode)(model_dir, Path(out_dir), *overrides)
        comm.barrier()
    exit_process(0, barrier=True)
