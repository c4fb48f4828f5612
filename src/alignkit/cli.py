"""The ``alignkit`` command: train | validate | demo | tiny-model | data synth.

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

USER_ERRORS = (ConfigError, DataError, FileNotFoundError, ValueError, KeyError)


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

    generate(args.kind, args.n, args.seed, Path(args.out))
    print(f"wrote {args.n} {args.kind} rows to {args.out}")
    return 0


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

    sp = sub.add_parser("demo", help="build a tiny model, run SFT on the shipped data, print before/after")
    sp.add_argument("--output-dir", default="runs/demo")
    sp.add_argument("--max-steps", type=int, default=None)
    sp.add_argument("--size", default="tiny", choices=["micro", "tiny", "small"])
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


def main(argv: list[str] | None = None) -> int:
    argv = _strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
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
