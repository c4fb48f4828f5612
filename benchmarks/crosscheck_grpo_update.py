#!/usr/bin/env python
"""One GRPO update, alignkit against TRL 1.16's GRPOTrainer on the same completions (issue 39).

    python benchmarks/crosscheck_grpo_update.py      # needs results/.venv-trl and results/models/learn-mul
                                                     # (learn_grpo_vs_trl.py builds both)

Does anything other than the loss aggregation differ in what one update computes ("the log-probs the update
sees")? The parent (alignkit installed) samples 64 completions (8 prompts x G=8, temperature 1.0, 12 new
tokens) from the benchmark's starting policy through alignkit's rollout, gives them fixed random rewards (every
group has a spread, so every completion carries a gradient), and computes alignkit's advantages, loss and the
gradient of every policy parameter through its own pipeline (``make_experience``, ``collate``, ``loss`` with
the step's normaliser). The child, in TRL's virtualenv, builds TRL's GRPOTrainer on the same policy and runs
TRL's OWN ``_compute_loss`` on the same prompt and completion ids (completion mask up to and including the
EOS, as TRL's generation path builds it), with advantages from the same rewards by TRL's formula. Pairs:
alignkit ``token_mean`` against TRL ``dapo`` (TRL's default) and ``sequence_mean`` against ``grpo``.
Reports the max absolute difference of the advantages and the loss, and of the gradient (max over every
parameter, and the norm of the difference over the norm of TRL's gradient).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PAIRS = {"token_mean": "dapo", "sequence_mean": "grpo"}
P, G, MAX_NEW = 8, 8, 12


def alignkit_side(policy: str, prompts_file: str, aggregation: str, out: Path) -> dict[str, Any]:
    """alignkit's rollout of 64 completions and one update's loss and gradient; the inputs for TRL."""
    sys.path.insert(0, str(REPO / "src"))
    import torch
    from safetensors.torch import save_file

    from alignkit.algorithms import ALGORITHMS, workload_of
    from alignkit.config import load_config
    from alignkit.data.prompts import prompt_text
    from alignkit.distributed.env import DistEnv
    from alignkit.models.loading import load_tokenizer
    from alignkit.rollout.context import RolloutContext
    from alignkit.rollout.engine import SamplingParams, build_engine
    from alignkit.train.runner import build_models, strategy_for

    torch.set_num_threads(2)
    cfg = load_config(None, [
        "algorithm=grpo", f"model.name_or_path={policy}", "output_dir=/tmp/unused", f"data.train={prompts_file}",
        f"rollout.num_generations={G}", f"rollout.max_new_tokens={MAX_NEW}", "rollout.temperature=1.0",
        "grpo.beta=0.0", f"grpo.loss_aggregation={aggregation}", f"training.per_device_batch_size={P * G}",
    ])
    tok = load_tokenizer(cfg.model)
    algo = ALGORITHMS.get("grpo")(cfg, tok)
    single = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)
    strategy = strategy_for(cfg, single)
    models = build_models(workload_of(cfg), cfg.model, strategy, tok,
                          make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    texts = [json.loads(x)["prompt"] for x in Path(prompts_file).read_text().splitlines()[:P]]
    rows = [{"prompt_ids": tok(prompt_text(tok, t), add_special_tokens=False)["input_ids"], "prompt": t, "fields": {}}
            for t in texts for _ in range(G)]
    ctx = RolloutContext(models, strategy, build_engine("hf", tok), rows, slice(0, P * G),
                         SamplingParams(MAX_NEW, 1.0), P * G, algo.collate)
    torch.manual_seed(0)
    samples = ctx.samples(ctx.generate("policy", [r["prompt_ids"] for r in rows]).completion_ids)
    rewards = torch.rand(P * G, generator=torch.Generator().manual_seed(1))
    algo.make_experience(ctx, samples, ctx.batches(samples), {"reward": rewards})
    models.train()
    batch = algo.collate(samples)
    loss, _ = algo.loss(models, batch, normalizer=float(algo.units(batch)))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in models["policy"].hf_model.named_parameters() if p.grad is not None}
    save_file(grads, str(out / f"alignkit-{aggregation}.safetensors"))
    return {"prompt_ids": [r["prompt_ids"] for r in rows], "completion_ids": [s["completion_ids"] for s in samples],
            "rewards": rewards.tolist(), "advantages": [s["advantages"][0] for s in samples], "loss": float(loss.detach()),
            "pad": tok.pad_token_id, "lengths": [len(s["completion_ids"]) for s in samples]}


def trl_child(spec: dict[str, Any]) -> dict[str, Any]:
    """TRL's _compute_loss on the parent's ids, advantages by TRL's formula; differences against alignkit."""
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(2)
    from bench_grpo import make_trl_trainer
    from trl.trainer.utils import nanstd

    a = spec["alignkit"]
    spec = {**spec, "trl_overrides": {"loss_type": spec["loss_type"]}}
    trainer = make_trl_trainer(spec, lambda *x, **k: [0.0] * len(x[1]), batch=P * G, max_new=MAX_NEW, lr=1e-3,
                               steps=1, seed=0)
    trainer.current_gradient_accumulation_steps = 1  # set by train(); one step, no accumulation
    width_p = max(len(x) for x in a["prompt_ids"])
    width_c = max(len(x) for x in a["completion_ids"])
    pad = a["pad"]
    prompt_ids = torch.tensor([[pad] * (width_p - len(x)) + x for x in a["prompt_ids"]])  # left-padded, as TRL
    prompt_mask = torch.tensor([[0] * (width_p - len(x)) + [1] * len(x) for x in a["prompt_ids"]])
    completion_ids = torch.tensor([x + [pad] * (width_c - len(x)) for x in a["completion_ids"]])
    completion_mask = torch.tensor([[1] * len(x) + [0] * (width_c - len(x)) for x in a["completion_ids"]])
    rewards = torch.tensor(a["rewards"])
    mean = rewards.view(-1, G).mean(1).repeat_interleave(G)
    advantages = (rewards - mean) / (nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G) + 1e-4)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": completion_mask.sum()}
    model = trainer.model
    model.train()
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    mine = load_file(spec["grads"])
    diffs, num, den = {}, 0.0, 0.0
    for n, p in model.named_parameters():
        if p.grad is None or n not in mine:
            continue
        d = (p.grad - mine[n]).abs()
        diffs[n] = float(d.max())
        num += float(d.pow(2).sum())
        den += float(p.grad.pow(2).sum())
    return {"loss_type": spec["loss_type"], "dtype": str(next(model.parameters()).dtype),
            "params_compared": len(diffs), "params_missing": [n for n in mine if n not in diffs],
            "advantage_max_abs_diff": float((advantages - torch.tensor(a["advantages"])).abs().max()),
            "loss_trl": float(loss), "loss_alignkit": a["loss"], "loss_abs_diff": abs(float(loss) - a["loss"]),
            "grad_max_abs_diff": max(diffs.values()), "grad_norm_trl": den ** 0.5,
            "grad_rel_diff": (num / den) ** 0.5 if den else float("nan"),
            "completion_tokens": int(completion_mask.sum()), "length_range": [min(a["lengths"]), max(a["lengths"])]}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(HERE))
        print("RESULT " + json.dumps(trl_child(json.loads(Path(sys.argv[2]).read_text()))), flush=True)
        return
    results = HERE / "results"
    policy = results / "models" / "learn-mul" / "sft" / "final"
    sys.path.insert(0, str(HERE))
    from learn_grpo_vs_trl import write_task_data

    work = Path(tempfile.mkdtemp(prefix="xcheck-grpo-"))
    prompts = write_task_data(work)["prompts"]
    report = {}
    for aggregation, loss_type in PAIRS.items():
        a = alignkit_side(str(policy), prompts, aggregation, work)
        spec = {"policy": str(policy), "prompts": prompts, "run_dir": str(work / "trl"), "loss_type": loss_type,
                "grads": str(work / f"alignkit-{aggregation}.safetensors"), "alignkit": a}
        (work / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run([str(results / ".venv-trl" / "bin" / "python"), __file__, "--child", str(work / "spec.json")],
                              capture_output=True, text=True, cwd=str(REPO), check=False,
                              env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"})
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        report[f"{aggregation} vs {loss_type}"] = json.loads(line[-1][7:]) if line else {"error": proc.stderr[-2000:]}
        print(json.dumps(report[f"{aggregation} vs {loss_type}"], indent=1), flush=True)
    (results / "crosscheck_grpo_update.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
