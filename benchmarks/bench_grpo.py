"""GRPO side by side: alignkit's online loop vs TRL's GRPOTrainer, same model, prompts, group size and
lengths, in one run (each side in its own subprocess; TRL in its own virtualenv, never a dependency).

Two shapes (``--shapes``), both sides on each:

* ``tiny``: the BASELINES ``tiny`` Llama (random init, fp32, vocab 8192), 32 completions per optimizer step
  (4 prompts x G 8), ``max_new_tokens`` 16 (a random model rarely stops: most completions are full length);
  2 warm-up + 8 timed iterations;
* ``micro``: the ``micro`` Llama (~0.2 M parameters), 64 completions per step (8 prompts x G 8),
  ``max_new_tokens`` 8: the shape where the framework's per-iteration overhead dominates; 5 + 40 iterations.

Both: single-digit sum prompts rendered with the chat template, ``num_generations`` 8, temperature 1.0,
beta 0 (no reference model), AdamW lr 1e-6 constant, one update per iteration, ``torch.set_num_threads(2)``.
The reward (identical on both sides, ``bench_rewards.digit_fraction``) is the fraction of digits in the
completion, so rewards vary within a group.

Measured per side: seconds per optimizer step over the timed steps (after warm-up), completions/s
(samples/s), generated tokens/s, peak RSS, and where an iteration goes (ms, mean over the timed ones):
alignkit from its ``time/*`` metrics (generation, score inputs (decode + collate), reward functions,
gathers, experience (old/ref log-probs, advantages), rest of the rollout, update, logging, evaluation +
checkpointing); TRL from timers around its GRPOTrainer methods (``_generate``, ``_calculate_rewards``, the
rest of ``_generate_and_score_completions``, the loss + backward of ``training_step``, and the rest: the
optimizer step and the Trainer's bookkeeping). Usage::

    python benchmarks/bench_grpo.py [--shapes tiny,micro] [--warmup N --timed N] [--skip-trl] [--engines hf]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_data  # noqa: E402  (stdlib only)

RESULT_TAG = "BENCH_RESULT "
THREADS = 2
G = 8
LR = 1e-6
#: shape -> model size, completions per iteration, max new tokens, (warm-up, timed) iterations
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"size": "tiny", "batch": 32, "max_new": 16, "steps": (2, 8)},
    "micro": {"size": "micro", "batch": 64, "max_new": 8, "steps": (5, 40)},
}



def write_prompts(path: Path, n: int = 400) -> Path:
    rows = [{"prompt": f"What is {i % 10}+{(i * 7) % 10}?", "answer": str(i % 10 + (i * 7) % 10)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ====================================================================== children
def child_alignkit(spec: dict[str, Any]) -> dict[str, Any]:
    if (REPO / "src" / "alignkit").is_dir():  # this checkout's alignkit, not whichever is installed
        sys.path.insert(0, str(REPO / "src"))
    import torch

    torch.set_num_threads(THREADS)
    from alignkit.algorithms.grpo import GRPO
    from alignkit.config import load_config
    from alignkit.train.runner import run_train

    stamps: list[float] = []
    gen_tokens: list[float] = []
    phases: list[dict[str, float]] = []
    original = GRPO.on_step_end
    batch = spec["batch"]

    def stamped(self: Any, ctx: Any) -> dict[str, float]:  # after each iteration's updates
        stamps.append(time.perf_counter())
        gen_tokens.append(ctx.metrics.get("completion_length", 0.0) * batch)
        phases.append({k[5:-2]: v for k, v in ctx.metrics.items() if k.startswith("time/")})
        return original(self, ctx)

    GRPO.on_step_end = stamped  # type: ignore[method-assign]
    cfg = load_config(None, [
        "algorithm=grpo", f"model.name_or_path={spec['model']}", f"output_dir={spec['run_dir']}",
        f"data.train={spec['prompts']}", "data.max_length=64", f"rollout.num_generations={G}",
        f"rollout.max_new_tokens={spec['max_new']}", "rollout.temperature=1.0", "rollout.log_samples=0",
        f"rollout.engine={spec['engine']}",
        "reward.functions=[{name: 'bench_rewards:digit_fraction', weight: 1.0}]",
        f"training.per_device_batch_size={batch}", f"training.learning_rate={LR}", "training.lr_scheduler=constant",
        f"training.max_steps={spec['warmup'] + spec['timed']}", "training.seed=0", "logging.report_to=[jsonl]",
        "logging.logging_steps=1000", "logging.plot=false", "checkpoint.save_final=false",
    ])
    run_train(cfg)
    return {"stamps": stamps, "gen_tokens": gen_tokens, "phases": phases, "peak_rss_mib": bench_data.peak_rss_mib()}


def make_trl_trainer(spec: dict[str, Any], reward: Any, *, batch: int, max_new: int, lr: float, steps: int,
                     seed: int, callbacks: list[Any] | None = None) -> Any:
    """TRL's GRPOTrainer on ``spec["model"]`` (or ``spec["policy"]``) and the prompt rows ``spec["prompts"]``
    (``prompt`` as one user turn, ``answer`` passed to the reward): G generations, beta 0, constant lr without
    warm-up, one update per generation batch, CPU fp32; the rest GRPOConfig's defaults, except the fields
    ``spec["trl_overrides"]`` sets (``{field: value}``)."""
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    rows = [json.loads(x) for x in Path(spec["prompts"]).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in rows])
    path = spec.get("policy") or spec["model"]
    model: Any = path
    if spec.get("freeze"):  # alignkit's model.freeze: the named parameters get no gradient and no optimizer state
        import re

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path)
        for name, param in model.named_parameters():
            if any(re.search(x, name) for x in spec["freeze"]):
                param.requires_grad_(False)
    fields = {
        "output_dir": spec["run_dir"], "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1,
        "num_generations": G, "max_completion_length": max_new, "temperature": 1.0, "beta": 0.0,
        "learning_rate": lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "max_steps": steps, "seed": seed,
        "use_cpu": True, "bf16": False, "fp16": False, "report_to": "none", "logging_steps": 10**6,
        "save_strategy": "no", "disable_tqdm": True, "num_iterations": 1,
    }
    args = trl.GRPOConfig(**{**fields, **spec.get("trl_overrides", {})})  # an override replaces a field above
    return trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                           processing_class=AutoTokenizer.from_pretrained(path), callbacks=callbacks)


#: TRL GRPOTrainer methods timed per iteration (phase name -> method); a method TRL lacks is left out
TRL_PHASES = {"generate": "_generate", "reward": "_calculate_rewards", "rollout": "_generate_and_score_completions",
              "training_step": "training_step"}


def _time_methods(obj: Any, methods: dict[str, str], acc: dict[str, float]) -> None:
    """Wrap ``obj``'s methods so each call adds its seconds to ``acc[phase]``."""
    for phase, name in methods.items():
        fn = getattr(obj, name, None)
        if fn is None:
            continue

        def timed(*a: Any, _fn: Any = fn, _phase: str = phase, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[_phase] = acc.get(_phase, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(THREADS)
    import transformers
    import trl
    from bench_rewards import digit_fraction
    from transformers import TrainerCallback

    stamps: list[float] = []
    gen_tokens: list[float] = []
    phases: list[dict[str, float]] = []
    acc: dict[str, float] = {}

    class Stamp(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            stamps.append(time.perf_counter())
            phases.append(dict(acc))
            acc.clear()

    def reward(prompts: Any, completions: Any, **kw: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        gen_tokens.append(float(sum(len(t) for t in kw.get("completion_ids", [])) or 0))
        return [x if x is not None else 0.0 for x in digit_fraction(prompts, texts)]

    trainer = make_trl_trainer(spec, reward, batch=spec["batch"], max_new=spec["max_new"], lr=LR,
                               steps=spec["warmup"] + spec["timed"], seed=0, callbacks=[Stamp()])
    _time_methods(trainer, TRL_PHASES, acc)
    trainer.train()
    return {"stamps": stamps, "gen_tokens": gen_tokens, "phases": phases, "peak_rss_mib": bench_data.peak_rss_mib(),
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}


CHILDREN = {"alignkit": child_alignkit, "trl": child_trl}


# ====================================================================== parent
def run_child(python: str, kind: str, spec: dict[str, Any], log_path: Path) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(HERE))
    proc = subprocess.run([python, str(Path(__file__)), "--child", kind, json.dumps(spec)], capture_output=True,
                          text=True, env=env, cwd=str(HERE))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}\n", encoding="utf-8")
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} failed (exit {proc.returncode}); see {log_path}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def summarize(res: dict[str, Any], warmup: int, prompt_tokens: float, batch: int) -> dict[str, float]:
    """Per side: s/step, iterations/s, samples/s, generated tokens/s (the side's own completion tokens of the
    timed steps) and trained tokens/s (those + ``prompt_tokens`` per completion: both sides train on the
    prompt + completion sequences of the same prompt set), peak RSS."""
    s = res["stamps"]
    first = warmup if warmup else 1
    seconds = (s[-1] - s[first - 1]) / (len(s) - first)
    gen = sum(res["gen_tokens"][first:]) / (s[-1] - s[first - 1])
    return {"s_per_step": seconds, "it_per_s": 1 / seconds, "samples_per_s": batch / seconds, "gen_tokens_per_s": gen,
            "train_tokens_per_s": gen + batch * prompt_tokens / seconds, "peak_rss_mib": res["peak_rss_mib"]}


def phase_breakdown(side: str, res: dict[str, Any], warmup: int) -> dict[str, float]:
    """Mean ms per timed iteration by phase, ``other`` = the iteration's interval minus the phases (the
    loop's own bookkeeping; for TRL also the optimizer step, which no public method isolates)."""
    first = warmup if warmup else 1
    s, rows = res["stamps"], res.get("phases") or []
    intervals = [b - a for a, b in zip(s[first - 1 :], s[first:])]
    rows = rows[first : first + len(intervals)]
    if not rows:
        return {}
    mean = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in {k for r in rows for k in r}}
    if side == "trl":
        roll = mean.get("rollout", 0.0)
        out = {"generate": mean.get("generate", 0.0), "reward": mean.get("reward", 0.0),
               "rollout_other": roll - mean.get("generate", 0.0) - mean.get("reward", 0.0),
               "update (loss+backward)": mean.get("training_step", 0.0) - roll}
    else:
        out = dict(mean)
    out["other"] = sum(intervals) / len(intervals) - sum(out.values())
    return {k: 1000 * v for k, v in out.items()}


def mean_prompt_tokens(model: str, prompts: Path) -> float:
    """Mean tokens of a prompt as both sides render it (one user turn, the chat template's assistant opener)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x) for x in prompts.read_text().splitlines()]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                     tokenize=False) for r in rows]
    return sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts) / len(texts)


def run_shape(shape: str, a: argparse.Namespace, out: Path, work: Path, prompts: Path) -> tuple[list[str], dict[str, Any]]:
    """Every side on one shape: the table lines and the raw results."""
    from bench_sft_dpo import ensure_models, ensure_trl_venv

    sh = SHAPES[shape]
    warm, timed = sh["steps"] if a.warmup is None else (a.warmup, a.timed or sh["steps"][1])
    model = ensure_models(out / "models", [sh["size"]])[sh["size"]]
    spec = {"model": model, "prompts": str(prompts), "warmup": warm, "timed": timed, "batch": sh["batch"],
            "max_new": sh["max_new"]}
    engines = a.engines.split(",")
    results = {}
    for engine in engines:
        name = "alignkit" if engine == engines[0] else f"alignkit-{engine}"
        results[name] = run_child(sys.executable, "alignkit", {**spec, "engine": engine,
                                                               "run_dir": str(work / f"{shape}-{name}")},
                                  work / f"{shape}-{name}.log")
    if not a.skip_trl:
        py = ensure_trl_venv(out / ".venv-trl")
        results["trl"] = run_child(str(py), "trl", {**spec, "run_dir": str(work / f"{shape}-trl")}, work / f"{shape}-trl.log")
    prompt_tokens = mean_prompt_tokens(model, prompts)
    rows = {k: summarize(v, warm, prompt_tokens, sh["batch"]) for k, v in results.items()}
    lines = [f"## {shape}: {sh['size']} Llama, G={G}, {sh['batch']} completions/step, max_new_tokens={sh['max_new']}, "
             f"{warm} warm-up + {timed} timed iterations (alignkit = rollout.engine {engines[0]})", "",
             "| side | s/step | it/s | samples/s | generated tok/s | trained tok/s | peak RSS MiB |",
             "|---|---|---|---|---|---|---|"]
    for k, r in rows.items():
        lines.append(f"| {k} | {r['s_per_step']:.3f} | {r['it_per_s']:.2f} | {r['samples_per_s']:.2f} | "
                     f"{r['gen_tokens_per_s']:.0f} | {r['train_tokens_per_s']:.0f} | {r['peak_rss_mib']:.0f} |")
    if "trl" in rows:
        lines += ["", f"alignkit / TRL: {rows['alignkit']['samples_per_s'] / rows['trl']['samples_per_s']:.2f}x samples/s, "
                  f"{rows['alignkit']['peak_rss_mib'] / rows['trl']['peak_rss_mib']:.2f}x peak RSS; TRL "
                  f"{results['trl'].get('versions', {})}"]
    lines += ["", "Where a timed iteration goes (ms, mean):", ""]
    for k, v in results.items():
        ph = phase_breakdown("trl" if k == "trl" else "alignkit", v, warm)
        lines.append(f"- {k}: " + ", ".join(f"{p} {ms:.1f}" for p, ms in ph.items()))
    return lines, {"rows": rows, "raw": results}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"))
    ap.add_argument("--shapes", default="tiny,micro", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default: the shape's)")
    ap.add_argument("--timed", type=int, default=None, help="timed iterations (default: the shape's)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--engines", default="hf", help="alignkit rollout engines to measure (first = the headline)")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    if a.child:
        result = CHILDREN[a.child[0]](json.loads(a.child[1]))
        print("\n" + RESULT_TAG + json.dumps(result), flush=True)
        return
    shapes = [x for x in a.shapes.split(",") if x]
    for x in shapes:
        if x not in SHAPES:
            ap.error(f"unknown shape {x!r}; choose from {', '.join(SHAPES)}")
    out = Path(a.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = out / "work" / f"grpo-{stamp}"
    work.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(work / "prompts.jsonl")
    load = os.getloadavg()[0]
    lines = [f"# GRPO, alignkit vs TRL ({stamp}; load average {load:.2f} at the start on {os.cpu_count()} cores)", ""]
    raw = {}
    for shape in shapes:
        got, raw[shape] = run_shape(shape, a, out, work, prompts)
        lines += got + [""]
    text = "\n".join(lines)
    print(text)
    (out / f"grpo-{stamp}.md").write_text(text + "\n", encoding="utf-8")
    (out / f"grpo-{stamp}.json").write_text(json.dumps(raw, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
