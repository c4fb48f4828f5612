"""``alignkit generate CONFIG_OR_MODEL FILE``: completions of a prompt file, for inspection.

CONFIG_OR_MODEL is a run config (the model is its ``OUTPUT_DIR/final`` when that exists, else
``model.name_or_path``, said in one line; ``rollout.max_new_tokens`` / ``temperature`` are the defaults) or a model
directory (or hub id). FILE holds rows with ``prompt`` (a string or a message list) -- for a vision-language model, image-text
rows (LLaVA ``conversations`` or ``messages`` with image parts, answered after their last user turn,
greedily); each output row
is the input row plus ``completion`` (or ``completions`` with ``--num-generations`` > 1), and, with
``--reward``, the named reward function's score of each. A text-to-image (``diffusion``) policy writes image grids
instead (``cli/generate_images.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections)
from alignkit.cli.generate_images import generate_images, is_diffusion_target, say_no_final
from alignkit.config import load_config
from alignkit.config.schema import ModelConfig
from alignkit.data.io import read_rows, require_field
from alignkit.models.adapter_dirs import adapter_base, is_adapter_dir
from alignkit.models.adapters import is_vision_language, load_lm
from alignkit.models.loading import load_tokenizer
from alignkit.models.sources import model_errors
from alignkit.rewards.functions import REWARD_FUNCTIONS, WeightedFunction, call, resolve
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.generate import generate
from alignkit.rollout.vlm_generate import generate_with_images, image_prompts, load_vlm_for_generation


def _model_and_defaults(target: str) -> tuple[str, int, float, str]:
    if target.endswith((".yaml", ".yml")):
        cfg = load_config(target, [])
        final = Path(cfg.output_dir) / "final"
        model = str(final) if (final / "config.json").is_file() or (final / "adapter_config.json").is_file() \
            else cfg.model.name_or_path
        if model != str(final):
            say_no_final(final, model)
        r = cfg.section(RolloutConfig)
        return model, r.max_new_tokens, r.temperature, r.engine
    return target, 32, 0.0, "hf"


def _load(model_dir: str) -> tuple[Any, Any]:
    """A causal LM (full or LoRA adapter directory) and its tokenizer, frozen, for generation."""
    cfg = ModelConfig(name_or_path=model_dir)
    if is_adapter_dir(model_dir) and not (Path(model_dir) / "tokenizer_config.json").is_file():
        cfg.tokenizer = adapter_base(model_dir)
    with model_errors(model_dir):
        model = load_lm(cfg, trainable=False)
    model.eval().requires_grad_(False)
    return model, load_tokenizer(cfg)


def _is_vision_language(model_dir: str) -> bool:
    return is_vision_language(adapter_base(model_dir) if is_adapter_dir(model_dir) else model_dir)


def cmd_generate(args: argparse.Namespace) -> int:
    if is_diffusion_target(args.target, args.base):  # a text-to-image policy: image grids
        return generate_images(args)
    model_dir, max_new, temperature, engine = _model_and_defaults(args.target)
    max_new = args.max_new_tokens or max_new
    temperature = temperature if args.temperature is None else args.temperature
    rows = read_rows(args.file)
    n = args.num_generations
    if _is_vision_language(model_dir):  # image-text rows (LLaVA JSON / messages with image parts), greedy
        prompts, images = image_prompts(rows, args.image_root)
        model, processor = load_vlm_for_generation(model_dir)
        texts = generate_with_images(model, processor, [p for p in prompts for _ in range(n)],
                                     [i for i in images for _ in range(n)], max_new_tokens=max_new,
                                     batch_size=args.batch_size)
        flat: list[Any] = [p for p in prompts for _ in range(n)]  # reward functions get the chats as message lists
    else:
        prompts = [require_field(r, "prompt") for r in rows]
        model, tok = _load(model_dir)
        flat = [p for p in prompts for _ in range(n)]
        texts = generate(model, tok, flat, max_new_tokens=max_new, batch_size=args.batch_size,
                         do_sample=temperature > 0, temperature=temperature or 1.0, engine=args.engine or engine)
    scores: list[float] | None = None
    if args.reward:
        fn = WeightedFunction(args.reward, 1.0, resolve(args.reward) if args.reward not in REWARD_FUNCTIONS
                              else REWARD_FUNCTIONS.get(args.reward))
        fields = {k: [r.data.get(k) for r in rows for _ in range(n)] for k in sorted({k for r in rows for k in r.data})
                  if k != "prompt"}
        scores = call(fn, flat, texts, fields)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for i, row in enumerate(rows):
            rec: dict[str, Any] = dict(row.data)
            mine = texts[i * n : (i + 1) * n]
            rec["completion" if n == 1 else "completions"] = mine[0] if n == 1 else mine
            if scores is not None:
                got = scores[i * n : (i + 1) * n]
                rec["score" if n == 1 else "scores"] = got[0] if n == 1 else got
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if scores is not None:
        ok = [s for s in scores if s == s]
        print(f"{args.reward}: mean {sum(ok) / max(1, len(ok)):.4f} over {len(ok)} completions", file=sys.stderr)
    return 0
