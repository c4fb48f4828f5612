"""examples/: the real-model recipes (issue 42.5) load as configs and are sized by ``alignkit estimate`` against
config-only copies of the real models' dimensions (each model's published ``config.json`` numbers, no weights, no
network), the way ``estimate --preset`` sizes a preset: the policy's parameter count is the published one and the
recipe fits the GPUs its header names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok, run_cli

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

#: Hub id -> (transformers config class, its published numbers, published parameter count in billions)
LMS = {
    "Qwen/Qwen2.5-1.5B-Instruct": ("Qwen2Config", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                   tie_word_embeddings=True, max_position_embeddings=32768), 1.54),
    "Qwen/Qwen2.5-7B-Instruct": ("Qwen2Config", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                 tie_word_embeddings=False, max_position_embeddings=32768), 7.62),
    "meta-llama/Llama-3.1-8B-Instruct": ("LlamaConfig", dict(hidden_size=4096, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                                         vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                                         max_position_embeddings=131072), 8.03),
}
SD35 = "stabilityai/stable-diffusion-3.5-medium"
#: the estimate's GPUs per example: what its header's first command names
GPUS = {"sft_lora_llama3.1-8b": 1, "dpo_lora_llama3.1-8b": 1}


def write_sd35_medium(root: Path) -> Path:
    """SD3.5 Medium's pipeline configs (model_index.json and each component's config.json, as published)."""
    clip = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=0, eos_token_id=2)
    parts = {
        "transformer": ("diffusers", "SD3Transformer2DModel", dict(
            attention_head_dim=64, caption_projection_dim=1536, in_channels=16, joint_attention_dim=4096,
            num_attention_heads=24, num_layers=24, out_channels=16, patch_size=2, pooled_projection_dim=2048,
            pos_embed_max_size=384, qk_norm="rms_norm", dual_attention_layers=list(range(13)), sample_size=128)),
        "vae": ("diffusers", "AutoencoderKL", dict(
            in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2,
            norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
            use_post_quant_conv=False)),
        "text_encoder": ("transformers", "CLIPTextModelWithProjection", dict(
            model_type="clip_text_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
            num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu", **clip)),
        "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", dict(
            model_type="clip_text_model", hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
            num_attention_heads=20, projection_dim=1280, hidden_act="gelu", **clip)),
        "text_encoder_3": ("transformers", "T5EncoderModel", dict(
            model_type="t5", d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
            feed_forward_proj="gated-gelu", is_encoder_decoder=False)),
    }
    index = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": "0.31.0",
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    for name, (library, cls, cfg) in parts.items():
        index[name] = [library, cls]
        (root / name).mkdir(parents=True)
        extra = {"_class_name": cls} if library == "diffusers" else {"architectures": [cls]}
        (root / name / "config.json").write_text(json.dumps({**extra, **cfg}), encoding="utf-8")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "num_train_timesteps": 1000}))
    (root / "model_index.json").write_text(json.dumps(index), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Hub id -> a folder holding only that model's configs."""
    import transformers

    root = tmp_path_factory.mktemp("config-only")
    out = {}
    for hub_id, (cls, numbers, _) in LMS.items():
        getattr(transformers, cls)(**numbers).save_pretrained(root / hub_id.replace("/", "--"))
        out[hub_id] = root / hub_id.replace("/", "--")
    out[SD35] = write_sd35_medium(root / "sd35")
    # the reward and cost models the examples train (Qwen2.5-1.5B-Instruct with a score head)
    out["models/helpful_rm/final"] = out["models/harmless_rm/final"] = out["Qwen/Qwen2.5-1.5B-Instruct"]
    return out


def test_every_example_is_in_the_readme() -> None:
    readme = (REPO / "examples" / "README.md").read_text(encoding="utf-8")
    assert len(EXAMPLES) >= 10
    for path in EXAMPLES:
        assert f"`{path.name}`" in readme, f"examples/README.md does not list {path.name}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_sized_on_the_real_dimensions(example: Path, config_only: dict[str, Path], tmp_path: Path) -> None:
    text = example.read_text(encoding="utf-8")
    names = [name for name in config_only if name in text]
    assert names, f"{example.name} names no model of this test's list"
    for name in names:  # the models only: data, keys and values stay as the user gets them
        text = text.replace(name, str(config_only[name]))
    copy = tmp_path / example.name
    copy.write_text(text, encoding="utf-8")
    gpus = GPUS.get(example.stem, 8)
    proc = run_cli(["estimate", str(copy), "--gpus", str(gpus), "--gpu-memory", "80GB"], cwd=tmp_path,
                   env={"HF_HUB_OFFLINE": "1"})
    assert_ok(proc)
    policy = next(name for name in names if name in LMS or name == SD35)
    billions = float(re.search(r"^# policy ([\d.]+)B", proc.stdout, flags=re.MULTILINE).group(1))
    if policy in LMS:
        assert billions == pytest.approx(LMS[policy][2], abs=0.01), proc.stdout[:400]
    else:  # SD3.5 Medium's MMDiT-X: 2.2B (the 2.5B of its model card counts more than the transformer)
        assert 2.0 < billions < 2.6, proc.stdout[:400]
    fits = re.search(r"^fits in 80\.0 GB per GPU \(.*\): (.*)$", proc.stdout, flags=re.MULTILINE).group(1)
    assert not fits.startswith("none"), proc.stdout[-1500:]
