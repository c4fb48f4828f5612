"""On-policy distillation against SFT on the teacher's samples, on two-digit addition (issue 47's claim: a student
distilled from a trained teacher closes most of the teacher's lead, faster than SFT on the teacher's samples).

This replaces the earlier digits-task measurement (tiny Llama, sampled accuracy of 100 prompts x 8: too noisy to tell
the arms apart, ``results/learn-distill-2026-11-28.md``). The task, data, start recipe and evaluator are
``learn_addition.py``'s (the GRPO learning benchmark): "What is 37+48?" -> "85" on the micro Llama, 200 held-out sums.

- Teacher T: ``learn_addition.py``'s start, the micro Llama SFT'd for 600 steps (``results/models/learn-add-600``,
  ``--teacher`` to read a cached copy elsewhere; built once if missing).
- Student S0: the same SFT recipe (cosine lr 3e-3, batch 32 packed) for ``--student-steps`` steps (default
  ``S0_STEPS``), cached in ``results/models/learn-add-<steps>``: well below T by expected accuracy.

Then per seed, from S0, the same N optimizer steps of 64 completions on each arm (``--generations`` g per prompt,
64 / g prompts per step, default g 1: 64 prompts x 1; prompts in the order ``torch.randperm(500)`` seeded with the
seed, as alignkit's ``GlobalOrder`` draws them), AdamW at a constant lr, every weight trained (``--freeze on``:
``la.FREEZE``, embeddings + block 0, as the GRPO benchmark does):

- **distill**: ``algorithm: distill`` (the full-vocabulary divergence to T per token on the student's own samples,
  temperature 1, ``max_new_tokens`` 6, ``distill.beta`` 1 = reverse KL; ``--betas`` a grid);
- **sft**: SFT on T's samples (temperature 1, the seed's draws) for the same prompts, g per prompt, one completion
  per row, 64 rows per step, unpacked: the same number of completions of the same prompts (the SFT loader shuffles
  the rows over the run).

Each arm saves a checkpoint every N/3 steps; each checkpoint, S0 and T are scored on the held-out sums by
``policy_eval.expected_accuracy`` (the exact P(right answer) at temperature 1, teacher forced: no sampling noise),
by sampled accuracy beside it (8 draws per sum, common random numbers) and by the per-token reverse KL to T on its
own samples of the held-out prompts (``held_out_kl``: what distillation minimises, on prompts it never trains on).
Fraction of T's lead closed at a checkpoint: (acc - acc(S0)) / (acc(T) - acc(S0)); mean with a 95% t interval over
seeds, and the paired difference distill - SFT. ``--lrs`` runs a small lr grid on the first ``--seeds`` seeds of
both arms (the sweep; ``--freeze on,off`` and ``--betas`` grid too); ``--lr-distill`` and ``--lr-sft`` set each
arm's rate for the paired runs. One thread per run, ``--jobs`` runs at a time (``--wait-file`` holds each run while
a file exists: a shared machine's idle flag).

    python benchmarks/learn_distill.py --teacher PATH --seeds 1 --steps 180 --lrs 3e-4,1e-3,3e-3 --tag sweep-g1
    python benchmarks/learn_distill.py --teacher PATH --seeds 8 --tag g1-300

Why 64 prompts x 1 and every weight (2026-11-29, ``results/learn-distill-2026-11-29-*.md``): the first setting
(8 prompts x 8, embeddings + block 0 frozen) closed only 0.063 of the lead in 60 steps and 0.130 in 180. Nothing
was wrong in the loss (a probe matched alignkit's per-token divergence to a plain transformers computation to 0.0,
the targets shifted by one, EOS in and padding out of the mask, T the teacher, in eval mode); two settings held
it back. (1) 8 prompts per step: a plain-PyTorch distillation loop at 8 x 8 (all weights, lr 1e-3) reached 0.062
expected accuracy at step 120 and 0.230 at 64 x 1; the SFT arm had silently had the advantage, its loader
shuffling its rows over the whole run (64 prompts per step). Distillation compares no groups, so one completion
per prompt is the natural setting. (2) The frozen input side: with all weights trained both arms learn several
times faster (the seed-0 sweeps ``-sweep-freeze``, ``-sweep-beta``, ``-sweep-g1``). Lr 1e-3 was both arms' best of
{3e-4, 1e-3, 3e-3} at 64 x 1 (3e-3 diverges for both). The 8-seed measurement (``-g1-300``, the defaults):
fraction of the lead closed at steps 100 / 200 / 300, distill 0.215 ± 0.088 / 0.632 ± 0.134 / 0.856 ± 0.027, SFT
0.176 ± 0.064 / 0.495 ± 0.049 / 0.585 ± 0.063, paired +0.039 ± 0.068 / +0.137 ± 0.150 / +0.271 ± 0.072.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import learn_addition as la  # benchmarks/ is not a package

S0_STEPS = 300
BATCH = 64
G = 1
MAX_NEW = la.MAX_NEW
STEPS = 300
EVAL_SAMPLES = 8


def common(run: Path, seed: int, steps: int, lr: float, every: int, freeze: bool) -> list[str]:
    """Overrides both arms share: batch, schedule, freeze (``la.FREEZE`` or nothing), checkpoints, logging."""
    frozen = ["model.freeze=[" + ", ".join(f"'{x}'" for x in la.FREEZE) + "]"] if freeze else []
    return [f"output_dir={run}", "data.max_length=64", f"training.per_device_batch_size={BATCH}",
            f"training.learning_rate={lr}", "training.lr_scheduler=constant", "training.warmup_steps=0",
            f"training.max_steps={steps}", f"training.seed={seed}", f"checkpoint.save_steps={every}",
            "checkpoint.save_total_limit=null", "logging.report_to=[jsonl]", "logging.logging_steps=1",
            "logging.plot=false", "distributed.strategy=single", *frozen]


def child_train(spec: dict[str, Any]) -> dict[str, Any]:
    """One arm of one seed in this process (1 thread); ``sft`` first samples T's completions for its rows."""
    import torch

    torch.set_num_threads(la.THREADS)
    from alignkit.config import load_config
    from alignkit.train.runner import run_train

    run = Path(spec["run"])
    base = common(run, spec["seed"], spec["steps"], spec["lr"], spec["every"], spec["freeze"])
    if spec["arm"] == "distill":
        cfg = ["algorithm=distill", f"model.name_or_path={spec['student']}", f"distill.teacher={spec['teacher']}",
               f"distill.beta={spec['beta']}", f"data.train={spec['prompts']}", f"rollout.num_generations={spec['g']}",
               f"rollout.max_new_tokens={MAX_NEW}",
               "rollout.temperature=1.0", "rollout.log_samples=0",
               "reward.functions=[{name: 'bench_rewards:exact_answer', weight: 1.0}]"]
        tokens = None
    else:
        rows, tokens = teacher_rows(spec)
        data = run.parent / f"{run.name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        cfg = ["algorithm=sft", f"model.name_or_path={spec['student']}", f"data.train={data}", "data.packing=false"]
    t0 = time.perf_counter()
    run_train(load_config(None, [*cfg, *base]))
    return {"seconds": time.perf_counter() - t0, "completion_tokens": tokens}


def teacher_rows(spec: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """``steps x 64 / g`` prompts in the seed's ``randperm`` order (cycled), each with ``g`` completions T samples
    at temperature 1 (seeded by the seed; 64 prompts per ``generate`` call, all of one length: digits are single
    tokens): chat rows, and the completions' token count (EOS included)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = [json.loads(x)["prompt"] for x in Path(spec["prompts"]).read_text().splitlines()]
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(spec["seed"])).tolist()
    g = spec["g"]
    picked = [prompts[order[i % len(order)]] for i in range(spec["steps"] * BATCH // g)]
    tok = AutoTokenizer.from_pretrained(spec["teacher"])
    model = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(spec["seed"])
    rows, tokens = [], 0
    per_step = BATCH // g
    for start in range(0, len(picked), per_step):  # one step's prompts per call: one length, no padding
        chunk = picked[start:start + per_step]
        ids = torch.tensor([tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                        tokenize=False), add_special_tokens=False)["input_ids"]
                            for p in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=MAX_NEW, num_return_sequences=g, pad_token_id=pad)
        new = out[:, ids.shape[1]:]
        is_eos = (new == tok.eos_token_id).long()
        tokens += int(((is_eos.cumsum(-1) - is_eos) == 0).sum())  # up to and including the first EOS
        texts = tok.batch_decode(new, skip_special_tokens=True)  # num_return_sequences repeats each prompt in place
        rows += [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
                 for j, p in enumerate(chunk) for c in texts[j * g:(j + 1) * g]]
    return rows, tokens


def child_eval(spec: dict[str, Any]) -> dict[str, Any]:
    """Expected and sampled held-out accuracy of each path, and its per-token reverse KL to the teacher."""
    import policy_eval
    import torch

    torch.set_num_threads(la.THREADS)
    rows = la.held_out_rows()
    return {p: {"expected": policy_eval.expected_accuracy(p, rows),
                "sampled": policy_eval.evaluate(p, samples=EVAL_SAMPLES, max_new=MAX_NEW, seed=la.EVAL_SEED,
                                                rows=rows)["reward"],
                "kl": held_out_kl(p, spec["teacher"], rows)} for p in spec["paths"]}


def held_out_kl(path: str, teacher: str, rows: list[tuple[str, str]]) -> float:
    """Per-token reverse KL(student || teacher) over the full vocabulary, at the completion positions (EOS
    included, padding after it left out) of ``EVAL_SAMPLES`` completions the student at ``path`` samples per
    held-out prompt (temperature 1, seeded): what ``algorithm: distill`` minimises (beta 1), on prompts it never
    trains on."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    student, ref = (AutoModelForCausalLM.from_pretrained(x, dtype=torch.float32).eval() for x in (path, teacher))
    groups: dict[int, list[list[int]]] = {}
    for q, _ in rows:
        ids = tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=False), add_special_tokens=False)["input_ids"]
        groups.setdefault(len(ids), []).append(ids)
    total, count = 0.0, 0
    for g, (length, prompts) in enumerate(sorted(groups.items())):
        torch.manual_seed(la.EVAL_SEED * 1000 + g)
        with torch.no_grad():
            x = torch.tensor(prompts)
            seqs = student.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0, top_k=0,
                                    top_p=1.0, max_new_tokens=MAX_NEW, num_return_sequences=EVAL_SAMPLES,
                                    pad_token_id=tok.pad_token_id)
            new = seqs[:, length:]
            is_eos = (new == tok.eos_token_id).long()
            keep = (is_eos.cumsum(-1) - is_eos) == 0  # up to and including the first EOS
            s, t = (m(seqs).logits[:, length - 1:-1].log_softmax(-1) for m in (student, ref))
            total += float(((s.exp() * (s - t)).sum(-1) * keep).sum())
            count += int(keep.sum())
    return total / count


CHILDREN = {"train": child_train, "eval": child_eval}


def child_cmd(kind: str, spec: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(spec)]


def checkpoint_model(run: str, step: int) -> str:
    """The trained model's folder of ``run``'s checkpoint at ``step`` (the role that is not the teacher)."""
    folders = [p.parent for p in sorted((Path(run) / f"checkpoint-{step}").glob("*/config.json"))
               if p.parent.name != "teacher"]
    assert len(folders) == 1, folders
    return str(folders[0])


def closed(acc: float, start: dict[str, float], teacher: dict[str, float], key: str) -> float:
    return (acc - start[key]) / (teacher[key] - start[key])


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per (arm, lr) and checkpoint: accuracy and fraction of the lead closed (t intervals over seeds); per
    checkpoint, distill - SFT paired by seed for each pair of lrs run on the same seeds."""
    s0, t = result["start"], result["teacher"]
    out: dict[str, Any] = {}
    for name, runs in result["runs"].items():
        row: dict[str, Any] = {}
        for step in result["checkpoints"]:
            row[str(step)] = {key: {"acc": la.t_interval([r["eval"][str(step)][key] for r in runs]),
                                    "closed": la.t_interval([closed(r["eval"][str(step)][key], s0, t, key)
                                                             for r in runs])} for key in ("expected", "sampled")}
        out[name] = row
    pairs = {}
    for d in (n for n in result["runs"] if n.startswith("distill")):
        for s in (n for n in result["runs"] if n.startswith("sft")):
            dr, sr = result["runs"][d], result["runs"][s]
            if [r["seed"] for r in dr] != [r["seed"] for r in sr] or len(dr) < 2:
                continue
            pairs[f"{d} - {s}"] = {str(step): {key: la.paired(
                [closed(r["eval"][str(step)][key], s0, t, key) for r in dr],
                [closed(r["eval"][str(step)][key], s0, t, key) for r in sr]) for key in ("expected", "sampled")}
                for step in result["checkpoints"]}
    return {"arms": out, "paired": pairs}


def markdown(result: dict[str, Any]) -> str:
    s0, t, summ = result["start"], result["teacher"], result["summary"]
    lines = [f"# On-policy distillation vs SFT on the teacher's samples: two-digit addition ({result['stamp']})", "",
             result["setup_text"], "",
             (f"Held-out accuracy ({la.HELD_OUT} sums), expected (exact) / sampled ({EVAL_SAMPLES} draws): student "
              f"start S0 {s0['expected']:.3f} / {s0['sampled']:.3f}, teacher T {t['expected']:.3f} / "
              f"{t['sampled']:.3f}; lead {t['expected'] - s0['expected']:+.3f} / {t['sampled'] - s0['sampled']:+.3f}."),
             "", "Fraction of T's lead closed (mean ± 95% t interval over seeds), expected accuracy (sampled beside):", "",
             "| arm (lr) | seeds | " + " | ".join(f"step {c}" for c in result["checkpoints"]) + " |",
             "|---|---|" + "---|" * len(result["checkpoints"])]
    for name, row in summ["arms"].items():
        cells = [f"{la.fmt(row[str(c)]['expected']['closed'], True)} ({row[str(c)]['sampled']['closed']['mean']:+.2f})"
                 for c in result["checkpoints"]]
        lines.append(f"| {name} | {len(result['runs'][name])} | " + " | ".join(cells) + " |")
    lines += ["", (f"Held-out per-token reverse KL(student || T) on the student's own samples (mean over seeds; S0 "
                   f"{s0['kl']:.3f}, T 0):"), "",
              "| arm | " + " | ".join(f"step {c}" for c in result["checkpoints"]) + " |",
              "|---|" + "---|" * len(result["checkpoints"])]
    for name, runs in result["runs"].items():
        lines.append(f"| {name} | " + " | ".join(f"{sum(r['eval'][str(c)]['kl'] for r in runs) / len(runs):.3f}"
                                                for c in result["checkpoints"]) + " |")
    if summ["paired"]:
        lines += ["", ("Paired by seed, distill - SFT in fraction closed, expected (sampled beside); higher / lower "
                      "= seeds where distill is ahead / behind:"), "",
                  "| pair | " + " | ".join(f"step {c}" for c in result["checkpoints"]) + " |",
                  "|---|" + "---|" * len(result["checkpoints"])]
        for name, row in summ["paired"].items():
            cells = [f"{la.fmt(row[str(c)]['expected'], True)} ({row[str(c)]['expected']['higher']}/"
                     f"{row[str(c)]['expected']['lower']}; sampled {row[str(c)]['sampled']['mean']:+.2f})"
                     for c in result["checkpoints"]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Per seed, expected accuracy at each checkpoint (seconds of training):", "",
              "| arm (lr) | seed | " + " | ".join(str(c) for c in result["checkpoints"]) + " | s |",
              "|---|---|" + "---|" * (len(result["checkpoints"]) + 1)]
    for name, runs in result["runs"].items():
        for r in runs:
            lines.append(f"| {name} | {r['seed']} | " + " | ".join(f"{r['eval'][str(c)]['expected']:.3f}"
                                                                  for c in result["checkpoints"])
                         + f" | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def run_all(a: argparse.Namespace, models: dict[str, str], prompts: str, work: Path) -> dict[str, list[dict]]:
    """Every (arm, lr, seed) run, ``--jobs`` at a time, then one evaluation child over every checkpoint."""
    every = a.steps // 3
    grid = ([("distill", lr, beta, fr) for lr in a.lrs_distill for beta in a.betas for fr in a.freezes_distill]
            + [("sft", lr, 1.0, fr) for lr in a.lrs_sft for fr in a.freezes_sft])
    jobs = [(*arm, seed) for seed in range(a.seeds) for arm in grid]

    def one(job: tuple[str, float, float, bool, int]) -> dict[str, Any]:
        arm, lr, beta, freeze, seed = job
        run = work / f"{arm}-{lr:g}-b{beta:g}-{'frozen' if freeze else 'all'}-{seed}"
        spec = {**models, "arm": arm, "lr": lr, "beta": beta, "freeze": freeze, "seed": seed, "steps": a.steps,
                "g": a.generations,
                "every": every, "run": str(run), "prompts": prompts}
        while a.wait_file and Path(a.wait_file).exists():  # a shared machine's "keep it idle" flag
            time.sleep(15)
        res = la.spawn(child_cmd("train", spec), work / f"{run.name}.log", 3600)
        if not res["ok"]:
            raise RuntimeError(f"{run.name} failed: {res['error']}")
        la.log(f"{run.name}: {res['wall_s']:.0f} s")
        return {**res, "seed": seed, "run": str(run)}

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        done = dict(zip(jobs, pool.map(one, jobs)))
    steps = [every, 2 * every, a.steps]
    paths = [models["student"], models["teacher"]] + [checkpoint_model(r["run"], c) for r in done.values() for c in steps]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:  # ``--jobs`` evaluation children over shares of the paths
        parts = list(pool.map(lambda k: la.spawn(child_cmd("eval", {"paths": paths[k::a.jobs],
                                                                    "teacher": models["teacher"]}),
                                                 work / f"eval-{k}.log", 3600), range(a.jobs)))
    if not all(p["ok"] for p in parts):
        raise RuntimeError(f"evaluation failed: {[p.get('error') for p in parts]}")
    ev = {k: v for p in parts for k, v in p.items() if k not in ("ok", "wall_s")}
    runs: dict[str, list[dict[str, Any]]] = {}
    for (arm, lr, beta, freeze, _), r in done.items():
        r["eval"] = {str(c): ev[checkpoint_model(r["run"], c)] for c in steps}
        name = f"{arm} (lr {lr:g}{f', beta {beta:g}' if arm == 'distill' else ''}, {'frozen' if freeze else 'all'})"
        runs.setdefault(name, []).append(r)
    return {"runs": runs, "start": ev[models["student"]], "teacher": ev[models["teacher"]], "checkpoints": steps}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print("\n" + la.RESULT_TAG + json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per arm (N)")
    ap.add_argument("--student-steps", type=int, default=S0_STEPS, help="SFT steps of the student start S0")
    ap.add_argument("--teacher", default="", help="T's model folder (default: OUT/models/learn-add-600/sft/final)")
    ap.add_argument("--lrs", default="", help="comma-separated lr grid run on both arms (a sweep)")
    ap.add_argument("--lr-distill", type=float, default=1e-3)
    ap.add_argument("--lr-sft", type=float, default=1e-3)
    ap.add_argument("--generations", type=int, default=G, help="completions per prompt (both arms; 64 / this "
                    "prompts per step)")
    ap.add_argument("--betas", default="1", help="comma-separated distill.beta grid (distill arm)")
    ap.add_argument("--freeze", default="off", help="comma-separated on / off: la.FREEZE frozen or every weight "
                    "trained (a grid on both arms)")
    ap.add_argument("--freeze-distill", default="", help="on / off for the distill arm alone (overrides --freeze)")
    ap.add_argument("--freeze-sft", default="", help="on / off for the SFT arm alone (overrides --freeze)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--wait-file", default="", help="before each training run, wait while this file exists")
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. sweep)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    a = ap.parse_args()
    grid = [float(x) for x in a.lrs.split(",") if x]
    a.lrs_distill, a.lrs_sft = (grid, grid) if grid else ([a.lr_distill], [a.lr_sft])
    a.betas = [float(x) for x in a.betas.split(",")]
    a.freezes_distill, a.freezes_sft = ([x == "on" for x in (arm or a.freeze).split(",")]
                                        for arm in (a.freeze_distill, a.freeze_sft))
    t0 = time.perf_counter()
    work = a.out / "work" / "learn-addition"
    have = {"prompts": str(work / "prompts.jsonl"), "sft": str(work / "sft.jsonl")}
    data = have if all(Path(x).is_file() for x in have.values()) else la.write_task_data(work)
    models = {"student": la.ensure_policy(a.out, data, a.student_steps),
              "teacher": a.teacher or la.ensure_policy(a.out, data, la.SFT_STEPS)}
    result = run_all(a, models, data["prompts"], a.out / "work" / "learn-distill" / time.strftime("%H%M%S"))
    torch_version = __import__("torch").__version__
    result.update(stamp=time.strftime("%Y-%m-%d %H:%M"), models=models, setup={
        "student_sft_steps": a.student_steps, "teacher_sft_steps": la.SFT_STEPS, "steps": a.steps, "batch": BATCH,
        "generations": a.generations, "max_new_tokens": MAX_NEW, "freeze": la.FREEZE,
        "freeze_distill": a.freezes_distill, "freeze_sft": a.freezes_sft, "betas": a.betas, "threads": la.THREADS,
        "jobs": a.jobs,
        "torch": torch_version, "held_out": la.HELD_OUT, "eval_samples": EVAL_SAMPLES})
    result["setup_text"] = (
        f"micro Llama; S0 = {a.student_steps} SFT steps, T = {la.SFT_STEPS} SFT steps of learn_addition.py's recipe; "
        f"{a.steps} steps of {BATCH} completions ({BATCH // a.generations} prompts x {a.generations}, <= {MAX_NEW} "
        f"tokens) per arm, AdamW constant lr, 'frozen' = embeddings + block 0 frozen, 'all' = every weight trained, "
        f"{la.THREADS} thread per run, {a.jobs} runs at a time; "
        f"torch {torch_version}; wall {time.perf_counter() - t0:.0f} s")
    result["summary"] = summarize(result)
    name = f"learn-distill-{time.strftime('%Y-%m-%d')}{'-' + a.tag if a.tag else ''}"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{name}.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (a.out / f"{name}.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))


if __name__ == "__main__":
    main()
