"""Commands around runs: score, merge-lora, vllm-serve, demo (``cli/parser.py`` holds their arguments)."""

from __future__ import annotations

import argparse
from pathlib import Path

from alignkit.cli.score_command import score_command
from alignkit.demo import run_demo
from alignkit.models.adapters import merge_lora
from alignkit.rollout.vllm_engine import VLLMConfig
from alignkit.rollout.vllm_server import serve


def cmd_score(args: argparse.Namespace) -> int:
    score_command(args.model_dir, args.file, args.out, batch_size=args.batch_size, max_length=args.max_length,
                  chat_template=args.chat_template)
    return 0


def cmd_merge_lora(args: argparse.Namespace) -> int:
    out = merge_lora(args.adapter_dir, args.out_dir, base=args.base)
    print(f"wrote the merged model to {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    run_demo(Path(args.output_dir), max_steps=args.max_steps, size=args.size)
    return 0


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    serve(args.model, host=args.host, port=args.port, dtype=args.dtype, max_model_len=args.max_model_len,
          settings=VLLMConfig(gpu_memory_utilization=args.gpu_memory_utilization))
    return 0
