#!/usr/bin/env python
"""VLM SFT side by side: alignkit ``vlm_sft`` vs TRL 1.16's ``SFTTrainer`` on the same tiny LLaVA and data.

    python benchmarks/bench_vlm.py                 # 3 alternating runs of each side (alignkit, TRL, alignkit, ...)
    python benchmarks/bench_vlm.py --quick --runs 1   # smoke test (1 warm-up + 3 timed steps)
    python benchmarks/bench_vlm.py --skip-trl      # alignkit only

Setup (both sides): ``build_tiny_llava(size="tiny")`` (what ``alignkit tiny-model OUT --arch llava`` and
configs/vlm_sft.yaml use: CLIP tower 64-wide x 2 layers on 32x32 images in 8x8 patches = 16 image tokens,
projector, the BASELINES ``tiny`` Llama), random init, fp32, SDPA; the shapes task's ``sft`` stage
(``synth_vlm.generate_vlm``: 2-3 question turns per image); batch 16 (configs/vlm_sft.yaml's global batch),
``max_length`` 160 (the config's), no packing (TRL 1.16 refuses packing and padding-free for vision data),
loss on assistant tokens only, vision tower frozen (projector + language model train), AdamW lr 1e-4
constant, grad clip 1.0, seed 0, no dataloader workers, ``torch.set_num_threads(2)``.

Data in the form each trainer takes: alignkit reads the LLaVA JSON (``data.image_root`` = its folder) and
its collator opens and preprocesses each micro-batch's images; TRL gets a ``datasets.Dataset`` with
``messages`` (string contents, the ``<image>`` placeholder removed: TRL's ``prepare_multimodal_messages``
puts the image part first in the first user turn, which renders the same text) and ``images`` (PIL), the
processor as ``processing_class``, ``assistant_only_loss=True`` with the model's chat template re-written
with ``{% generation %}`` markers around each assistant turn's content and end-of-turn (the tokens
alignkit's mask covers; the child checks the two templates render the same text for every row).

Measured per run, each in its own subprocess (``bench_sft_dpo.run_child``): a ``perf_counter`` stamp at
the end of every optimizer step, and the non-pad input tokens (image tokens included: the
``attention_mask`` sum, as on both sides) and loss tokens of each step; tok/s = tokens of the timed steps
/ the window from the end of the last warm-up step to the end of the last timed step; peak RSS of the
child. Runs alternate alignkit, TRL, alignkit, ...; the table gives medians and min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_sft_dpo as common  # noqa: E402  (stdlib only at import: the TRL venv runs this file too)

RESULT_TAG = common.RESULT_TAG
BATCH = 16
MAX_LENGTH = 160
LR = 1e-4
SEED = 0
STEPS = (3, 30)
QUICK_STEPS = (1, 3)

#: the tiny LLaVA's chat template (models/tiny_vlm.VLM_CHAT_TEMPLATE) with ``{% generation %}`` markers around
#: each assistant turn's content and its ``<|im_end|>\n``: what TRL's assistant_only_loss reads
_CONTENT = ("{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<image>\n{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
            "{% endfor %}{% endif %}")
MARKED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}" + _CONTENT + "<|im_end|>\n{% endgeneration %}"
    "{% else %}" + _CONTENT + "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def trl_rows(llava_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """LLaVA rows -> ``{"messages": [...string contents...], "image": path}`` (``<image>`` placeholder removed)."""
    out = []
    for r in llava_rows:
        msgs = [{"role": _ROLES[t["from"]], "content": t["value"].replace("<image>\n", "").replace("<image>", "")}
                for t in r["conversations"]]
        out.append({"messages": msgs, "image": r["image"]})
    return out


# ====================================================================== TRL child (runs in the TRL venv)
def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    common._child_env_setup()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration, TrainerCallback

    warm, timed = spec["warmup"], spec["timed"]
    root = Path(spec["image_root"])
    rows = trl_rows(json.loads(Path(spec["data_path"]).read_text()))
    processor = AutoProcessor.from_pretrained(spec["model_path"])
    original = processor.chat_template
    for r in rows:  # the marked template must render exactly what the model's own renders
        from trl.data_utils import prepare_multimodal_messages

        msgs = prepare_multimodal_messages(r["messages"], images=[None])
        a = processor.apply_chat_template(msgs, tokenize=False)
        b = processor.apply_chat_template(msgs, tokenize=False, chat_template=MARKED_TEMPLATE)
        if a != b:
            raise RuntimeError(f"the marked chat template renders differently:\n{a!r}\n{b!r}")
    processor.chat_template = MARKED_TEMPLATE
    dataset = Dataset.from_dict({"messages": [r["messages"] for r in rows],
                                 "images": [[Image.open(root / r["image"]).convert("RGB")] for r in rows]})
    model = LlavaForConditionalGeneration.from_pretrained(spec["model_path"], dtype=torch.float32,
                                                          attn_implementation="sdpa")
    for name, p in model.named_parameters():  # alignkit's vlm.stage=sft: the vision tower stays frozen
        if "vision_tower" in name:
            p.requires_grad_(False)
    rec: dict[str, Any] = {"step_end": [], "step_tokens": [], "step_loss_tokens": [],
                           "original_template_had_markers": "generation" in (original or "")}
    pending = [0, 0]

    class Stamp(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # after optimizer + scheduler
            rec["step_end"].append(time.perf_counter())
            rec["step_tokens"].append(pending[0])
            rec["step_loss_tokens"].append(pending[1])
            pending[0] = pending[1] = 0

    class Timed(trl.SFTTrainer):  # type: ignore[misc]
        def training_step(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            pending[0] += int(inputs["attention_mask"].sum())
            pending[1] += int((inputs["labels"][:, 1:] != -100).sum())  # predicted tokens (labels shift by one)
            return super().training_step(model, inputs, *a, **kw)

    args = trl.SFTConfig(
        output_dir=spec["run_dir"], per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_steps=warm + timed, seed=SEED,
        max_grad_norm=1.0, weight_decay=0.0, bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
        report_to="none", logging_steps=10**6, save_strategy="no", eval_strategy="no", dataloader_num_workers=0,
        disable_tqdm=True, max_length=MAX_LENGTH, packing=False, padding_free=False, assistant_only_loss=True,
    )
    trainer = Timed(model=model, args=args, train_dataset=dataset, processing_class=processor, callbacks=[Stamp()])
    rec["trainable_params"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    rec["peak_rss_mib"] = common._peak_rss_mib()
    rec["versions"] = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    return rec


# ====================================================================== parent
def ensure_vlm_model(models_dir: Path) -> str:
    path = models_dir / "tiny-llava"
    if not (path / "config.json").exists():
        common.log(f"building the tiny LLaVA in {path}")
        from alignkit.models.tiny_vlm import build_tiny_llava

        build_tiny_llava(path, size="tiny")
    return str(path)


def summarize(res: dict[str, Any], warm: int, timed: int) -> dict[str, Any]:
    ends, toks = res["step_end"], res["step_tokens"]
    if len(ends) < warm + timed:
        raise RuntimeError(f"only {len(ends)} step stamps, expected {warm + timed}")
    window = ends[warm + timed - 1] - ends[warm - 1]
    tokens = sum(toks[warm:warm + timed])
    return {"tok_s": tokens / window, "s_step": window / timed, "peak_rss_mib": res["peak_rss_mib"],
            "tokens": tokens, "loss_tokens": sum(res["step_loss_tokens"][warm:warm + timed]),
            "trainable_params": res.get("trainable_params")}


def _spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def render(runs: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    lines = [f"# VLM SFT: alignkit vs TRL {meta.get('trl_version') or '(skipped)'}, tiny LLaVA, shapes sft", "",
             f"{meta['when']} | {meta['cpu']} | {common.THREADS} threads | batch {BATCH}, max_length {MAX_LENGTH}, "
             f"{meta['warmup']} warm-up + {meta['timed']} timed steps | alignkit {meta['alignkit_commit']} | "
             f"load avg {meta['loadavg_start']:.2f} at the start, {meta['loadavg_end']:.2f} at the end"
             + (" | QUICK (smoke) run" if meta["quick"] else ""), "",
             "Medians over the runs (min-max). tok/s = non-pad input tokens (image tokens included) / second.", "",
             "| side | runs | tok/s | s/step | peak RSS MiB | loss tokens (timed) | trainable params |",
             "|---|---|---|---|---|---|---|"]
    for side, rs in runs.items():
        ok = [r for r in rs if r.get("ok")]
        if not ok:
            lines.append(f"| {side} | 0 of {len(rs)} ok: {rs[0].get('error', '?')[-120:] if rs else ''} | | | | | |")
            continue
        lines.append(f"| {side} | {len(ok)} | {_spread([r['tok_s'] for r in ok], '.0f')} | "
                     f"{_spread([r['s_step'] for r in ok], '.3f')} | {_spread([r['peak_rss_mib'] for r in ok], '.0f')} | "
                     f"{sorted({r['loss_tokens'] for r in ok})} | {ok[0]['trainable_params']:,} |")
    ak = [r for r in runs.get("alignkit", []) if r.get("ok")]
    tr = [r for r in runs.get("trl", []) if r.get("ok")]
    if ak and tr:
        speed = statistics.median(r["tok_s"] for r in ak) / statistics.median(r["tok_s"] for r in tr)
        rss = statistics.median(r["peak_rss_mib"] for r in ak) / statistics.median(r["peak_rss_mib"] for r in tr)
        pairs = [a["tok_s"] / t["tok_s"] for a, t in zip(ak, tr)]
        lines += ["", f"alignkit / TRL (medians): **{speed:.2f}x tok/s** (target >= 1.5; per alternating pair "
                  f"{', '.join(f'{x:.2f}' for x in pairs)}), **{rss:.2f}x peak RSS** (target <= 0.7)."]
        same = {(r["tokens"], r["loss_tokens"]) for r in ak + tr}
        lines.append("Input and loss tokens of the timed steps agree on both sides." if len(same) == 1 else
                     f"**Token counts differ between runs** (input, loss): {sorted(same)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per side, alternating (default 3)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS[0]} warm-up + {QUICK_STEPS[1]} timed steps")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--packing", action="store_true", help="alignkit with data.packing (TRL cannot pack vision data)")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--trl-venv", default=str(HERE / "results" / ".venv-trl"), help="TRL's virtualenv (created if missing)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        result = {"trl": child_trl}[a.child[0]](json.loads(a.child[1]))
        print("\n" + RESULT_TAG + json.dumps(result), flush=True)
        return 0

    from alignkit.data.synth_vlm import generate_vlm

    out = Path(a.out).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = out / "work" / f"vlm-{stamp}"
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    warm, timed = QUICK_STEPS if a.quick else STEPS
    model = ensure_vlm_model(out / "models")
    data = generate_vlm((warm + timed) * BATCH, SEED, work / "data" / "sft.json", stage="sft", split="train")
    trl_py = None if a.skip_trl else common.ensure_trl_venv(Path(a.trl_venv), extra={"PIL": "pillow"})
    spec = {"warmup": warm, "timed": timed, "model_path": model, "data_path": str(data),
            "image_root": str(data.parent), "max_length": MAX_LENGTH, "batch": BATCH, "lr": LR}
    ak_spec = {**spec, "algo": "vlm_sft", "packing": a.packing,
               "cfg_extra": {"vlm": {"stage": "sft", "loss_on": "assistant", "train_vision_tower": False},
                             "data": {"image_root": str(data.parent), "packing": a.packing}}}
    runs: dict[str, list[dict[str, Any]]] = {"alignkit": []} if a.skip_trl else {"alignkit": [], "trl": []}
    raw: list[dict[str, Any]] = []
    for i in range(a.runs):
        for side in runs:
            name = f"{side}-{i + 1}"
            common.log(f"{name} ...")
            if side == "alignkit":
                res = common.run_child(sys.executable, "alignkit", {**ak_spec, "run_dir": str(work / name)},
                                       work / f"{name}.log", a.timeout)
            else:
                res = common.run_child(str(trl_py), "trl", {**spec, "run_dir": str(work / name)}, work / f"{name}.log",
                                       a.timeout, script=Path(__file__).resolve())
            row: dict[str, Any] = {"ok": res.get("ok", False), "error": res.get("error", "")}
            if row["ok"]:
                try:
                    row.update(summarize(res, warm, timed))
                except RuntimeError as e:
                    row.update(ok=False, error=str(e))
            raw.append({"name": name, **res})
            runs[side].append(row)
            common.log(f"    {row['tok_s']:.0f} tok/s, {row['s_step']:.3f} s/step, peak RSS {row['peak_rss_mib']:.0f} MiB "
                       f"(load {res['loadavg_before']:.1f})" if row["ok"] else f"    FAILED: {row['error'][-300:]}")
    trl_ok = [r for r in raw if r.get("ok") and "trl" in r.get("versions", {})]
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": common.cpu_name(), "alignkit_commit": common.git_commit(),
            "trl_version": trl_ok[0]["versions"]["trl"] if trl_ok else None, "quick": a.quick, "warmup": warm,
            "timed": timed, "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0], "packing": a.packing,
            "batch": BATCH, "max_length": MAX_LENGTH, "lr": LR, "seed": SEED, "work_dir": str(work)}
    table = render(runs, meta)
    (out / f"vlm-{stamp}.md").write_text(table, encoding="utf-8")
    (out / f"vlm-{stamp}.json").write_text(json.dumps({"meta": meta, "runs": runs, "raw": raw}, indent=1),
                                           encoding="utf-8")
    print("\n" + table)
    return 0 if all(r["ok"] for rs in runs.values() for r in rs) else 2


if __name__ == "__main__":
    sys.exit(main())
