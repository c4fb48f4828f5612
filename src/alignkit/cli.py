"""The ``alignkit`` command: train | launch | validate | estimate | eval | score | merge-lora | demo | tiny-model | data synth.

User errors (bad config, bad data, missing files) end with one line ``alignkit: error: ...``
and exit status 2; set ALIGNKIT_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from alignkit.config.loader import ConfigError
from alignkit.data.io import DataError
from alignkit.distributed.preflight import PreflightError

USER_ERRORS = (ConfigError, DataError, FileNotFoundError, ValueError, KeyError, PreflightError)


def _strip_launcher_args(argv: list[str]) -> list[str]:
    """The ``deepspeed`` launcher appends ``--local_rank=N``; export it as LOCAL_RANK instead."""
    out = []
    for a in argv:
        if a.startswith("--local_rank=") or a.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
        else:
            out.append(a)
    return out


def cmd_train(args: argparse.Namespace) -> int:
    from alignkit.config import load_config
    from alignkit.train.runner import run_train

    cfg = load_config(args.config, args.overrides)
    run_train(cfg)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from alignkit.train.plan_cli import print_plan

    print_plan(args.config, args.overrides, world_size=args.world_size)
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from alignkit.models.tiny import build_tiny_model

    out = build_tiny_model(args.out_dir, arch=args.arch, size=args.size, vocab_size=args.vocab_size, seed=args.seed)
    print(f"wrote a random {args.size} {args.arch} model and its tokenizer to {out}")
    return 0


def cmd_data_synth(args: argparse.Namespace) -> int:
    from alignkit.data.synth import generate

    generate(args.kind, args.n, args.seed, Path(args.out), split=args.split)
    where = f" ({args.split} split)" if args.split else ""
    print(f"wrote {args.n} {args.kind} rows{where} to {args.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from alignkit.train.evaluate import eval_command

    eval_command(args.config, args.overrides, args.model, args.out)
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from alignkit.scoring import score_command

    score_command(args.model_dir, args.file, args.out, batch_size=args.batch_size, max_length=args.max_length,
                  chat_template=args.chat_template)
    return 0


def cmd_merge_lora(args: argparse.Namespace) -> int:
    from alignkit.models.adapters import merge_lora

    out = merge_lora(args.adapter_dir, args.out_dir, base=args.base)
    print(f"wrote the merged model to {out}")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from alignkit.train.estimate_cli import estimate_command

    estimate_command(args.config, args.overrides, gpus=args.gpus, gpu_memory=args.gpu_memory, preset=args.preset,
                     frozen=args.frozen)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from alignkit.config import load_config
    from alignkit.launch import build_launch, run_launch

    load_config(args.config, args.overrides)  # one error line here, not one per rank after start-up
    plan = build_launch(args.config, args.overrides, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                        launcher=args.launcher)
    return run_launch(plan, dry_run=args.dry_run)


def cmd_demo(args: argparse.Namespace) -> int:
    from alignkit.demo import run_demo

    run_demo(Path(args.output_dir), max_steps=args.max_steps, size=args.size)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alignkit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", help="YAML run config")
        sp.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. training.learning_rate=1e-4")

    sp = sub.add_parser("train", help="train with a YAML config (under any launcher, or alone)")
    with_config(sp)
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("validate", help="print the resolved config and the plan, then exit")
    with_config(sp)
    sp.add_argument("--world-size", type=int, default=None, help="plan for N processes (default: the launcher's)")
    sp.set_defaults(func=cmd_validate)

    sp = sub.add_parser("launch", help="run `alignkit train` under torchrun / deepspeed / accelerate (one or several nodes)")
    sp.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None,
                    help="processes on this node (default: its GPU count, 1 without GPUs)")
    sp.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    sp.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's index in [0, nnodes)")
    sp.add_argument("--master-addr", "--master_addr", default=None,
                    help="address of node 0 (required with --nnodes > 1; default 127.0.0.1)")
    sp.add_argument("--master-port", "--master_port", type=int, default=None,
                    help="rendezvous port (default 29500; on one node a free port if 29500 is taken)")
    sp.add_argument("--launcher", default="torchrun", choices=["torchrun", "deepspeed", "accelerate"])
    sp.add_argument("--dry-run", "--dry_run", action="store_true", help="print the command instead of running it")
    with_config(sp)
    sp.set_defaults(func=cmd_launch)

    sp = sub.add_parser("estimate", help="per-GPU memory of a config under ddp / ZeRO 1-3 / FSDP, and which fit")
    with_config(sp)
    sp.add_argument("--gpus", type=int, default=None, help="number of GPUs (default: the launcher's world size, or 1)")
    sp.add_argument("--gpu-memory", "--gpu_memory", default=None,
                    help="memory per GPU, e.g. 80GB or 64GiB (default: the local GPU's, if any)")
    sp.add_argument("--preset", default=None,
                    help="policy dimensions from a preset (llama-7b, mistral-7b, qwen2-0.5b) instead of model.name_or_path")
    sp.add_argument("--frozen", action="append", default=[], metavar="MODEL",
                    help="add a frozen reward/cost model (preset or local dir); repeat for several")
    sp.set_defaults(func=cmd_estimate)

    sp = sub.add_parser("eval", help="evaluate a model on the config's data.eval (RM/CM: pairwise accuracy, margin)")
    with_config(sp)
    sp.add_argument("--model", default=None,
                    help="model or adapter dir to evaluate (default: OUTPUT_DIR/final if it exists, else model.name_or_path)")
    sp.add_argument("--out", default=None, help="also write the metrics as one JSON line to this file")
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("score", help="score every response of a .jsonl/.parquet file with a reward or cost model")
    sp.add_argument("model_dir", help="a trained reward/cost model (full or LoRA adapter directory)")
    sp.add_argument("file", help="rows: prompt/chosen/rejected, PKU-SafeRLHF, prompt/response or messages")
    sp.add_argument("--out", default=None, help="write JSONL here (default: stdout)")
    sp.add_argument("--batch-size", type=int, default=16)
    sp.add_argument("--max-length", type=int, default=None,
                    help="default: data.max_length of the run that trained MODEL_DIR (its config.yaml), else 512")
    sp.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                    help="render string rows with the chat template (default: as MODEL_DIR was trained, else no)")
    sp.set_defaults(func=cmd_score)

    sp = sub.add_parser("merge-lora", help="merge a LoRA adapter into its base and save a plain HF model")
    sp.add_argument("adapter_dir")
    sp.add_argument("out_dir")
    sp.add_argument("--base", default=None, help="base model (default: the one recorded in adapter_config.json)")
    sp.set_defaults(func=cmd_merge_lora)

    sp = sub.add_parser("demo", help="build a tiny model, run SFT on the shipped data, print before/after")
    sp.add_argument("--output-dir", default="runs/demo")
    sp.add_argument("--max-steps", type=int, default=None)
    sp.add_argument("--size", default="micro", choices=["micro", "tiny", "small"],
                    help="the random model trained (default micro: learns the tasks in about a minute)")
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("tiny-model", help="write a tiny random model + tokenizer in Hugging Face format")
    sp.add_argument("out_dir")
    sp.add_argument("--arch", default="llama")
    sp.add_argument("--size", default="tiny", choices=["micro", "tiny", "small"])
    sp.add_argument("--vocab-size", type=int, default=None)
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(func=cmd_tiny_model)

    sp = sub.add_parser("data", help="data utilities")
    dsub = sp.add_subparsers(dest="data_command", required=True)
    ss = dsub.add_parser("synth", help="generate synthetic data with programmatically checkable answers")
    ss.add_argument("--kind", required=True, help="sft | sft-pc | pref | safety")
    ss.add_argument("--n", type=int, default=1000)
    ss.add_argument("--seed", type=int, default=0)
    ss.add_argument("--out", required=True, help="output .jsonl or .parquet")
    ss.add_argument("--split", choices=["train", "eval"], default=None,
                    help="only task instances of this split (train and eval rows never share a question); default both")
    ss.set_defaults(func=cmd_data_synth)
    return p


def _finish(code: int) -> int:
    """Under several processes, end without Python finalization: gloo can abort at exit
    ("terminate called without an active exception") after all work is done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _quiet_deepspeed_on_cpu() -> None:
    """Without a GPU, DeepSpeed (imported by transformers whenever it is installed) warns "Setting
    accelerator to CPU ... we were unable to detect it" on every command; naming the CPU
    accelerator, which it would pick anyway, says the same without the warning."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    _quiet_deepspeed_on_cpu()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a "*" positional at the first option: `CONFIG --gpus 8 a=b` leaves a=b over
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
    except USER_ERRORS as e:
        if os.environ.get("ALIGNKIT_DEBUG"):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"alignkit: error: {msg}", file=sys.stderr)
        return _finish(2)
    return _finish(code)
