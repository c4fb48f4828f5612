"""``Strategy.full_params``: generation from a sharded model (FSDP2, DeepSpeed ZeRO-3; trainable and
frozen) gives the same greedy tokens as the unsharded model, with the parameters gathered once for
the whole ``generate`` call and sharded again after.

Usage: ``torchrun --nproc_per_node=2 full_params.py MODEL_DIR REPORT.json``
"""

from __future__ import annotations

import json
import sys

import torch

from alignkit.config import load_config
from alignkit.distributed.comm import exit_process
from alignkit.distributed.env import read_env
from alignkit.models.loading import hf_model, load_tokenizer
from alignkit.models.roles import ModelSpec, build_model
from alignkit.train.runner import strategy_for

PROMPTS = ["Reverse the letters: a b c", "What is 2+3?"]


def generate(module: torch.nn.Module, tok) -> list[list[int]]:
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = hf_model(module).generate(**enc, max_new_tokens=8, do_sample=False, use_cache=True,
                                        pad_token_id=tok.pad_token_id)
    return out[:, enc["input_ids"].shape[1]:].tolist()


def count_sharded(module: torch.nn.Module) -> int:
    """Parameters held as shards (FSDP2 DTensors, or ZeRO-3 partitions whose local data is empty)."""
    from torch.distributed.tensor import DTensor

    n = 0
    for p in module.parameters():
        if isinstance(p, DTensor) or (hasattr(p, "ds_id") and p.data.numel() == 0):
            n += 1
    return n


def main(model_dir: str, report: str) -> None:
    env = read_env()
    out: dict = {}
    spec = ModelSpec("policy", model_dir, "lm", trainable=True)
    for engine, extra in (("fsdp", []), ("deepspeed", ["distributed.deepspeed.zero_stage=3"])):
        cfg = load_config(None, ["algorithm=sft", f"model.name_or_path={model_dir}", "data.train=x.jsonl",
                                 "training.per_device_batch_size=1", f"distributed.strategy={engine}", *extra])
        tok = load_tokenizer(cfg.model)
        torch.manual_seed(0)
        plain = build_model(spec, cfg.model, torch.float32, tok)
        want = generate(plain, tok)
        strategy = strategy_for(cfg, env)
        strategy.setup()
        handle = strategy.prepare(build_model(spec, cfg.model, torch.float32, tok),
                                  lambda m: torch.optim.AdamW(m.parameters(), lr=0.0))
        strategy.shard_frozen = True
        frozen = strategy.prepare_frozen(build_model(ModelSpec("reference", model_dir, "lm"), cfg.model, torch.float32, tok))
        row = {}
        for name, module in (("trainable", handle.module), ("frozen", frozen)):
            before = count_sharded(strategy.unwrap(module))
            with strategy.full_params(module) as full:
                inside = count_sharded(full)
                got = generate(full, tok)
            after = count_sharded(strategy.unwrap(module))
            row[name] = {"same": got == want, "sharded_before": before, "sharded_inside": inside,
                         "sharded_after": after, "got": got, "want": want}
        out[engine] = row
    if env.rank == 0:
        with open(report, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0, barrier=True)
