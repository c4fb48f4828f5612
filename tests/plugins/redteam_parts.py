"""Stand-ins for the red-team tests: a scorer that is a known function of the text it reads (so a test can
recompute every rank's rewards from attacks.jsonl) and a scripted target."""

from __future__ import annotations

from typing import Any


def vowel_share(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """The share of vowels among the letters of each target output (0 without letters)."""
    out = []
    for text in completions:
        letters = [c for c in text.lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
    return out


def attack_length(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """A quality stand-in: the attack's length in characters over 100."""
    return [len(p) / 100 for p in prompts]


def echo_target(attacks: list[str], **_: Any) -> list[str]:
    """A scripted target: answers each attack with the attack upper-cased."""
    return [a.upper() for a in attacks]


def build_classifier(out: str, tokenizer_dir: str, labels: list[str], *, multi_label: bool, seed: int = 0) -> str:
    """A tiny random Llama text classifier (``labels`` heads) with the tokenizer of ``tokenizer_dir``, saved at
    ``out`` in HF format: what ``name: toxicity`` loads by path."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.from_pretrained(tokenizer_dir)
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {name: i for i, name in enumerate(labels)}
    config.problem_type = "multi_label_classification" if multi_label else "single_label_classification"
    config.pad_token_id = tok.pad_token_id
    LlamaForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def bad_target(attacks: list[str], **_: Any) -> list[float]:
    """A broken target: numbers instead of answers."""
    return [1.0 for _ in attacks]


def vowel_share_logged(prompts: list[Any], completions: list[str], **fields: Any) -> list[float]:
    """:func:`vowel_share`, appending "RANK N" (the process that scored, how many) to $REDTEAM_SCORE_LOG."""
    import os

    path = os.environ.get("REDTEAM_SCORE_LOG")
    if path:
        with open(f"{path}.{os.environ.get('RANK', '0')}", "a", encoding="utf-8") as fh:
            fh.write(f"{os.environ.get('RANK', '0')} {len(completions)}\n")
    return vowel_share(prompts, completions, **fields)


def broken_judge(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """A judge that fails (on whichever rank runs it)."""
    raise RuntimeError("the judge's server is down")


def build_clip(out: str, tokenizer_dir: str, *, seed: int = 0) -> str:
    """A tiny random CLIP (32x32 images) with the tokenizer of ``tokenizer_dir`` and a PIL image processor, saved
    at ``out``: what ``name: clip_quality`` loads by path (``CLIPModel`` + ``CLIPProcessor``)."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 64, "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(out)
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(out)
    return out


def tiny_train_args(config: str, out: str, model: str, train: str, eval_: str, nproc: int, *, generations: int,
                    batch: int, max_new_tokens: int) -> list[str]:
    """``alignkit train`` arguments of a 2-iteration red-team run on tiny models (``batch`` completions per
    iteration split over ``nproc`` processes); the caller adds its ``redteam.*`` overrides."""
    return ["train", config, f"output_dir={out}", f"model.name_or_path={model}", f"data.train={train}",
            f"data.eval={eval_}", "data.max_length=64", f"rollout.num_generations={generations}",
            f"rollout.max_new_tokens={max_new_tokens}", f"training.per_device_batch_size={batch // nproc}",
            "training.max_steps=2", "training.eval_steps=2", "training.learning_rate=1e-3", "checkpoint.save_steps=null",
            "logging.logging_steps=1", "logging.plot=false", f"distributed.strategy={'ddp' if nproc > 1 else 'single'}"]


def cli_parts(root: Any, micro_model: Any) -> dict[str, Any]:
    """What the red-team CLI tests train with, under ``root``: a tiny random 6-head (Detoxify-style) classifier
    on the micro model's tokenizer, 24 training and 4 evaluation prompt rows."""
    from pathlib import Path

    from alignkit.data.synth import make_prompt_rows, write_rows

    labels = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]
    return {"classifier": Path(build_classifier(str(root / "tox"), str(micro_model), labels, multi_label=True)),
            "train": write_rows(make_prompt_rows(24, seed=0), root / "train.jsonl"),
            "eval": write_rows(make_prompt_rows(4, seed=1), root / "eval.jsonl")}


def build_tiny_sd(out: str, clip_dir: str, *, seed: int = 0) -> str:
    """A tiny random Stable Diffusion pipeline (diffusers; text encoder with the tokenizer of ``clip_dir``) saved at
    ``out``: what ``redteam.target.renderer`` loads by path."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, sample_size=8, cross_attention_dim=32,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
                                attention_head_dim=4)
    vae = AutoencoderKL(block_out_channels=[16, 32], down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4, norm_num_groups=8)
    tok = AutoTokenizer.from_pretrained(clip_dir)
    tok.model_max_length = 64
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=64, eos_token_id=tok.eos_token_id,
                                        pad_token_id=tok.pad_token_id))
    StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=text, tokenizer=tok, scheduler=DDIMScheduler(steps_offset=1, clip_sample=False),
                            safety_checker=None, feature_extractor=None, requires_safety_checker=False).save_pretrained(out)
    return out
