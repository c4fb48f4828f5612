"""Commands around runs: score, merge-lora, vllm-serve, demo, tiny-model, data synth."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from alignkit.errors import ConfigError, UserError


def cmd_score(args: argparse.Namespace) -> int:
    from alignkit.cli.score_command import score_command

    score_command(args.model_dir, args.file, args.out, batch_size=args.batch_size, max_length=args.max_length,
                  chat_template=args.chat_template)
    return 0


def cmd_merge_lora(args: argparse.Namespace) -> int:
    from alignkit.models.adapters import merge_lora

    out = merge_lora(args.adapter_dir, args.out_dir, base=args.base)
    print(f"wrote the merged model to {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from alignkit.demo import run_demo

    run_demo(Path(args.output_dir), max_steps=args.max_steps, size=args.size)
    return 0


#: ``tiny-model --arch sd3``: VAE fitting steps by default
VAE_STEPS = 300


#: written beside a tiny model: the arguments it was built with (the same arguments give the same files)
TINY_RECIPE = "alignkit-tiny-model.json"


def tiny_recipe(args: argparse.Namespace) -> dict[str, Any]:
    recipe = {"arch": args.arch, "size": args.size, "vocab_size": args.vocab_size, "seed": args.seed}
    return {**recipe, "vae_steps": args.vae_steps} if args.arch == "sd3" else recipe


def holds_this_tiny_model(out_dir: Path, recipe: dict[str, Any], overwrite: bool) -> bool:
    """Whether ``out_dir`` already holds the tiny model ``recipe`` builds (a page followed twice: kept as it is).
    A folder holding anything else is replaced only when asked (``--overwrite``): it may hold a model the user
    made or trained."""
    import json

    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if overwrite or not held:
        return False
    made = out_dir / TINY_RECIPE
    if made.is_file() and json.loads(made.read_text(encoding="utf-8")) == recipe:
        return True
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    raise UserError(f"{out_dir} is not empty (it holds {shown}): choose a new folder, or pass --overwrite to write "
                    "the tiny model over its files")


def cmd_tiny_model(args: argparse.Namespace) -> int:
    import json

    from alignkit.models.tiny import build_tiny_model

    recipe, out_dir = tiny_recipe(args), Path(args.out_dir)
    if holds_this_tiny_model(out_dir, recipe, args.overwrite):
        print(f"{out_dir} already holds this tiny model (the same arguments give the same files): kept")
        return 0
    if args.arch == "sd3":
        from alignkit.logging import setup_console
        from alignkit.models.tiny_sd3 import build_tiny_sd3

        setup_console(is_main=True)  # the VAE fit's progress (minutes) goes to the console
        if args.vae_steps:
            import logging

            logging.getLogger("alignkit").info(
                f"fitting the tiny SD3's VAE to the shapes scenes: {args.vae_steps} steps, a few minutes on a CPU "
                "(--vae-steps 0 skips it: a random VAE)")
        out = build_tiny_sd3(args.out_dir, size=args.size, vocab_size=args.vocab_size, seed=args.seed,
                             vae_steps=args.vae_steps)
    else:
        out = build_tiny_model(args.out_dir, arch=args.arch, size=args.size, vocab_size=args.vocab_size, seed=args.seed)
    (Path(out) / TINY_RECIPE).write_text(json.dumps(recipe) + "\n", encoding="utf-8")
    what = {"llava": "processor (image processor + tokenizer)", "sd3": "diffusers pipeline (transformer, VAE, "
            "text encoders, tokenizers, scheduler)"}.get(args.arch, "tokenizer")
    print(f"wrote a random {args.size} {args.arch} model and its {what} to {out}")
    return 0


def objects_range(text: str) -> tuple[int, int]:
    """``--objects``: ``N`` or ``LO-HI`` -> (lo, hi); the range itself is checked by the generator."""
    try:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--objects: expected N or LO-HI (e.g. 1 or 1-3), got {text!r}") from None


def cmd_data_synth(args: argparse.Namespace) -> int:
    where = f" ({args.split} split)" if args.split else ""
    if args.kind == "vlm":  # images too: written to images/ beside the rows
        from alignkit.data.synth_vlm import generate_vlm

        out = generate_vlm(args.n, args.seed, Path(args.out), stage=args.stage, split=args.split,
                           objects=objects_range(args.objects))
        print(f"wrote {args.n} vlm {args.stage} rows{where} to {out} and their images to {out.parent / 'images'}")
        return 0
    from alignkit.data.synth import generate

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    generate(args.kind, args.n, args.seed, Path(args.out), split=args.split, tasks=tasks)
    print(f"wrote {args.n} {args.kind} rows{where} to {args.out}")
    return 0


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    from alignkit.rollout.vllm_engine import VLLMConfig
    from alignkit.rollout.vllm_server import serve

    serve(args.model, host=args.host, port=args.port, dtype=args.dtype, max_model_len=args.max_model_len,
          settings=VLLMConfig(gpu_memory_utilization=args.gpu_memory_utilization))
    return 0


def register(sub: Any) -> None:
    _register_score(sub)
    _register_merge_lora(sub)
    _register_vllm_serve(sub)
    _register_demo(sub)
    _register_tiny_model(sub)
    _register_data(sub)


def _register_score(sub: Any) -> None:
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


def _register_merge_lora(sub: Any) -> None:
    sp = sub.add_parser("merge-lora", help="merge a LoRA adapter into its base and save a plain HF model")
    sp.add_argument("adapter_dir")
    sp.add_argument("out_dir")
    sp.add_argument("--base", default=None, help="base model (default: the one recorded in adapter_config.json)")
    sp.set_defaults(func=cmd_merge_lora)


def _register_vllm_serve(sub: Any) -> None:
    sp = sub.add_parser("vllm-serve", help="serve a model with vLLM for training runs' rollouts (vllm.server_url)")
    sp.add_argument("model", help="a Hugging Face model dir (the policy's start)")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--dtype", default="auto", help="auto = bfloat16 on a GPU, float32 on CPU")
    sp.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + completion served")
    sp.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    sp.set_defaults(func=cmd_vllm_serve)


def _register_demo(sub: Any) -> None:
    sp = sub.add_parser("demo", help="build a tiny model, run SFT on the shipped data, print before/after")
    sp.add_argument("--output-dir", default="runs/demo")
    sp.add_argument("--max-steps", type=int, default=None)
    sp.add_argument("--size", default="micro", choices=["micro", "tiny", "small"],
                    help="the random model trained (default micro: learns the tasks in about a minute on 2 idle CPU cores, "
                         "two on a busy or slower machine)")
    sp.set_defaults(func=cmd_demo)


def _register_tiny_model(sub: Any) -> None:
    sp = sub.add_parser("tiny-model", help="write a tiny random model + tokenizer in Hugging Face format")
    sp.add_argument("out_dir")
    sp.add_argument("--arch", default="llama", choices=["llama", "llava", "sd3"],
                    help="llava: a vision-language model (small CLIP vision tower + projector + the tiny Llama); sd3: "
                         "a flow-matching text-to-image pipeline in diffusers' format (needs diffusers)")
    sp.add_argument("--size", default="tiny", choices=["micro", "micro64", "tiny", "small"])
    sp.add_argument("--vocab-size", type=int, default=None)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--vae-steps", type=int, default=VAE_STEPS,
                    help="sd3: steps fitting the VAE to the synthetic shapes scenes, so decoded latents are pictures "
                         "(0: a random VAE)")
    sp.add_argument("--overwrite", action="store_true",
                    help="write into OUT_DIR although it holds files (default: refuse a folder that is not empty, "
                         "unless it holds the tiny model of the same arguments, which is kept)")
    sp.set_defaults(func=cmd_tiny_model)


def _register_data(sub: Any) -> None:
    sp = sub.add_parser("data", help="data utilities")
    dsub = sp.add_subparsers(dest="data_command", required=True)
    ss = dsub.add_parser("synth", help="generate synthetic data with programmatically checkable answers")
    ss.add_argument("--kind", required=True, help="sft | sft-pc | pref | safety | prompts (online algorithms: prompt + answer) | redteam (attacker "
                         "instructions) | redteam-attacker / redteam-target (SFT rows of a starting attacker / the trigger-word target) | redteam-judge (toxicity pairs for a cost model) | vlm (coloured shapes images)")
    ss.add_argument("--tasks", default=None,
                    help="comma-separated tasks: add, reverse, upper, digits (default: the first three; prompts: digits)")
    ss.add_argument("--n", type=int, default=1000)
    ss.add_argument("--seed", type=int, default=0)
    ss.add_argument("--out", required=True, help="output .jsonl or .parquet (vlm: .json LLaVA list or .jsonl)")
    ss.add_argument("--stage", choices=["pretrain", "sft", "preference", "beavertails_v"], default="sft",
                    help="vlm only: pretrain = captions, sft = questions with checkable answers, preference = image + "
                         "text pairs with helpful and safety labels (PKU-SafeRLHF fields), beavertails_v = the same "
                         "pairs in BeaverTails-V's fields")
    ss.add_argument("--split", choices=["train", "eval"], default=None,
                    help="only task instances of this split (train and eval rows never share a question); default both")
    ss.add_argument("--objects", default="1-3",
                    help="vlm only: objects a scene holds, N or LO-HI within 1-3 (e.g. 1: one coloured shape a scene, "
                         "the easiest scenes for a tiny text-to-image model to learn)")
    ss.set_defaults(func=cmd_data_synth)
