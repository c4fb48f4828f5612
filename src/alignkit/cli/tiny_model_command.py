"""``alignkit tiny-model OUT_DIR``: a tiny random model and its tokenizer (or processor, or diffusers pipeline) in
Hugging Face format; the same arguments give the same files (``cli/parser.py`` holds its arguments)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from alignkit.errors import UserError
from alignkit.logging import setup_console
from alignkit.models.tiny import build_tiny_model
from alignkit.models.tiny_sd3 import build_tiny_sd3

#: written beside a tiny model: the arguments it was built with (the same arguments give the same files)
TINY_RECIPE = "alignkit-tiny-model.json"


def tiny_recipe(args: argparse.Namespace) -> dict[str, Any]:
    recipe = {"arch": args.arch, "size": args.size, "vocab_size": args.vocab_size, "seed": args.seed}
    return {**recipe, "vae_steps": args.vae_steps} if args.arch == "sd3" else recipe


def holds_this_tiny_model(out_dir: Path, recipe: dict[str, Any], overwrite: bool) -> bool:
    """Whether ``out_dir`` already holds the tiny model ``recipe`` builds (a page followed twice: kept as it is).
    A folder holding anything else is replaced only when asked (``--overwrite``): it may hold a model the user
    made or trained."""
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
    recipe, out_dir = tiny_recipe(args), Path(args.out_dir)
    if holds_this_tiny_model(out_dir, recipe, args.overwrite):
        print(f"{out_dir} already holds this tiny model (the same arguments give the same files): kept")
        return 0
    if args.arch == "sd3":
        setup_console(is_main=True)  # the VAE fit's progress (minutes) goes to the console
        if args.vae_steps:
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
