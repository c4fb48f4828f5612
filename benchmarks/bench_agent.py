"""Generation throughput of multi-turn agent rollouts against single-turn rollouts of the same total tokens
(issue 48, "Measured").

Multi-turn: ``--trajectories`` calculator conversations of ``--turns`` policy turns, each turn ``--max-new`` sampled
ids (temperature 1), every running trajectory's next turn in ONE engine call (``rollout/agents/trajectory.py``,
the ``hf`` engine), the environment's reply appended token in, token out. So that every trajectory takes all its
turns whatever the (untrained) model writes, the environment answers every turn with a real calculator tool call
(parsed arguments aside: the call, its thread and time limit, the tool message, its rendering are the real ones).
Single-turn: the same prompts, one completion each of as many new ids as a trajectory's completion (policy +
environment ids), one engine call. Reported per mode (median of ``--timed`` runs after ``--warmup``):
trajectories/s, completion ids/s, policy ids/s, and for multi-turn the share of the wall time spent generating,
in the environment (tools) and rendering / encoding its replies (``agent/env_time_share`` and
``agent/render_time_share`` of a run). Usage::

    python benchmarks/bench_agent.py [--model PATH | --size micro|tiny] [--trajectories 32 --turns 4 --max-new 24]
        [--warmup 1 --timed 3] [--threads 1] [--out benchmarks/results/agent-DATE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from alignkit.rollout.agents.calculator import CalculatorEnv
from alignkit.rollout.agents.env import EnvState, StepResult
from alignkit.rollout.agents.render import MessageRenderer
from alignkit.rollout.agents.tools import ToolCall, call_tool
from alignkit.rollout.agents.trajectory import Limits, run_trajectories
from alignkit.rollout.engine import HFEngine, SamplingParams


class AlwaysCalls(CalculatorEnv):
    """The calculator environment as if the policy called the tool on its question every turn (never done)."""

    def step(self, state: EnvState, assistant_message: str) -> StepResult:
        question = state.row["prompt"].removeprefix("What is ").rstrip("?")
        result = call_tool(self.tools, ToolCall("calculator", {"expression": question}))
        state.counts.update([result.status])
        return StepResult([result.message()], 0.0, False)


def load(model_path: str | None, size: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_path is None:
        from alignkit.models.tiny import build_tiny_model

        model_path = str(build_tiny_model(Path(tempfile.mkdtemp()) / size, size=size, seed=0))
    return AutoModelForCausalLM.from_pretrained(model_path).eval(), AutoTokenizer.from_pretrained(model_path)


def rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"What is {100 + 7 * i}*{300 + 13 * i}?", "answer": str((100 + 7 * i) * (300 + 13 * i))}
            for i in range(n)]


def multi_turn(model: Any, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    env = AlwaysCalls()
    renderer = MessageRenderer(tok, env.schemas())
    engine = HFEngine(tok)
    clock: dict[str, float] = {}

    def generate(prompts: list[list[int]], max_new: int) -> Any:
        start = time.perf_counter()
        out = engine.generate(model, prompts, SamplingParams(max_new, temperature=1.0, batch_size=len(prompts)))
        clock["generate"] = clock.get("generate", 0.0) + time.perf_counter() - start
        return out

    start = time.perf_counter()
    trajs = run_trajectories(env, renderer, rows(args.trajectories), generate,
                             Limits(args.turns, 10**6, args.max_new), clock)
    wall = time.perf_counter() - start
    policy = sum(int(sum(t.loss_mask)) for t in trajs)
    total = sum(len(t.completion_ids) for t in trajs)
    return {"wall_s": wall, "trajectories": len(trajs), "completion_ids": total, "policy_ids": policy,
            "turns": sum(len(t.turn_spans) for t in trajs) / len(trajs),
            "generate_share": clock.get("generate", 0.0) / wall, "env_share": clock.get("env", 0.0) / wall,
            "render_share": clock.get("render", 0.0) / wall, "tool_ok": sum(t.state.counts["ok"] for t in trajs)}


def single_turn(model: Any, tok: Any, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    engine = HFEngine(tok)
    start = time.perf_counter()
    gens = engine.generate(model, prompts, SamplingParams(max_new, temperature=1.0, batch_size=len(prompts)))
    wall = time.perf_counter() - start
    total = sum(len(c) for c in gens.completion_ids)
    return {"wall_s": wall, "trajectories": len(prompts), "completion_ids": total, "policy_ids": total}


def rates(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the timed runs: per second and the time shares."""
    out = {"wall_s": statistics.median(r["wall_s"] for r in runs)}
    for key in ("trajectories", "completion_ids", "policy_ids"):
        out[f"{key}_per_s"] = statistics.median(r[key] / r["wall_s"] for r in runs)
        out[key] = runs[-1][key]
    for key in ("generate_share", "env_share", "render_share", "turns", "tool_ok"):
        if key in runs[-1]:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--size", default="micro")
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new", type=int, default=24)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timed", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load(args.model, args.size)
    env = AlwaysCalls()
    renderer = MessageRenderer(tok, env.schemas())
    multi: list[dict[str, Any]] = []
    single: list[dict[str, Any]] = []
    for i in range(args.warmup + args.timed):
        torch.manual_seed(i)
        m = multi_turn(model, tok, args)
        # the same prompts, one completion each as long as a trajectory's mean completion (policy + environment)
        prompts = [renderer.prompt_ids(env.reset(r)) for r in rows(args.trajectories)]
        s = single_turn(model, tok, prompts, round(m["completion_ids"] / m["trajectories"]))
        if i >= args.warmup:
            multi.append(m)
            single.append(s)
    result = {"config": {**vars(args), "model": args.model or f"tiny-model --size {args.size}"},
              "multi_turn": rates(multi), "single_turn": rates(single)}
    result["multi_over_single_completion_ids_per_s"] = (result["multi_turn"]["completion_ids_per_s"]
                                                        / result["single_turn"]["completion_ids_per_s"])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
