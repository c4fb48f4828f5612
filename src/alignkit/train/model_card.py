"""The model card (``README.md``) of every saved model folder: ``final/``, ``final_ROLE/``, ``epoch_N/``.

Hugging Face's format, built with ``huggingface_hub``'s :class:`ModelCard` so the Hub reads it as it reads its
own: a YAML header (``base_model``, ``library_name``, ``tags`` with the algorithm and ``alignkit``, ``datasets``
where data.train names Hub data sets, ``license`` and ``pipeline_tag`` where known) and a body saying what was
trained, the final and best evaluation metrics, the run's summary plot, how to load it, the command that
reproduces it (the resolved ``config.yaml`` saved beside the card) and the resolved config itself (secrets
masked). Everything is read from the folder, the resolved config and the run's ``metrics.jsonl``, so the card is
rewritten the same way at the end of the run, when the summary plot exists (:func:`write_model_card`).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from alignkit.data.sources import resolve_source
from alignkit.errors import DataError
from alignkit.files import write_text_atomic
from alignkit.logging import scrub
from alignkit.plot import METRICS_FILE, read_metrics

CARD = "README.md"
PLOT = "summary.png"
#: an ``org/name`` (or bare ``name``) Hub id, and a folder of the Hub's download cache (``models--org--name``)
HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
CACHE_DIR = re.compile(r"models--([\w.-]+?)--([\w.-]+)(?:/|$)")
#: model classes (config.json's ``architectures``, by suffix) -> the Hub's pipeline tag
PIPELINES = {"ForCausalLM": "text-generation", "ForSequenceClassification": "text-classification",
             "ForConditionalGeneration": "image-text-to-text"}
#: the transformers Auto class and preprocessor of each pipeline tag (the card's "How to use")
AUTO = {"text-generation": ("AutoModelForCausalLM", "AutoTokenizer"),
        "text-classification": ("AutoModelForSequenceClassification", "AutoTokenizer"),
        "image-text-to-text": ("AutoModelForImageTextToText", "AutoProcessor")}
#: diffusers' LoRA file (``save_lora_weights``): an adapter with no adapter_config.json
DIFFUSERS_LORA = "pytorch_lora_weights.safetensors"


def write_model_card(folder: Path, config_yaml: str, run_dir: Path, *, source: str | None = None,
                     what: str = "final model", role: str | None = None, plot: Path | None = None) -> Path:
    """Write ``folder/README.md`` for the model saved there (rank 0, after its weights are written); ``source``: what
    the role started from (default model.name_or_path); with ``plot`` (the run's summary.png) a copy goes into the
    folder and the card shows it. Returns the card's path."""
    cfg = yaml.safe_load(config_yaml) or {}
    source = source or str(cfg.get("model", {}).get("name_or_path", ""))
    if plot is not None and plot.is_file():
        shutil.copyfile(plot, folder / PLOT)
    library = library_of(folder)
    base, base_meta = base_model(source)
    card = build_card(folder, cfg, library, (source, base), base_meta, metrics=read_run_metrics(run_dir), what=what,
                      role=role)
    path = folder / CARD
    write_text_atomic(path, str(card))  # a rewrite at the end of the run never leaves half a card
    return path


def build_card(folder: Path, cfg: dict[str, Any], library: str, start: tuple[str, str | None], base_meta: dict[str, Any],
               *, metrics: dict[str, tuple[list[float], list[float]]], what: str, role: str | None) -> Any:
    """The card: ``start`` is (what training started from, the Hub id it descends from or None)."""
    from huggingface_hub import ModelCard, ModelCardData

    source, base = start
    algorithm = str(cfg.get("algorithm", "?"))
    lora = library == "peft" or (folder / DIFFUSERS_LORA).is_file()
    tags = ["alignkit", algorithm] + (["lora"] if lora else [])
    pipeline = pipeline_of(folder, library)
    data = ModelCardData(base_model=base, library_name=library, tags=tags, datasets=hub_datasets(cfg) or None,
                         license=base_meta.get("license"), license_name=base_meta.get("license_name"),
                         license_link=base_meta.get("license_link"), pipeline_tag=pipeline)
    repo = (cfg.get("hub") or {}).get("repo_id") if folder.name == "final" else None  # final/ is what is pushed
    parts = [
        f"# {repo or Path(str(cfg.get('output_dir', folder.parent))).name + '/' + folder.name}",
        _intro(algorithm, base, source, lora, what, role),
        _data_section(cfg),
        _metrics_section(metrics),
        f"## Training curves\n\n![training curves]({PLOT})" if (folder / PLOT).is_file() else "",
        _usage(library, pipeline, lora, repo or str(folder), base or source),
        _reproduce(),
        ("## Configuration\n\nThe resolved run configuration (`config.yaml` beside this card; secrets masked):\n\n"
         f"```yaml\n{yaml.safe_dump(scrub(cfg), sort_keys=False).rstrip()}\n```"),
        _versions(library),
    ]
    body = "\n\n".join(p for p in parts if p)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")


# ---------------------------------------------------------------------------------------- the header
def library_of(folder: Path) -> str:
    """peft for a LoRA adapter (the Hub loads it onto ``base_model``), diffusers for a pipeline or its LoRA, else
    transformers."""
    if (folder / "adapter_config.json").is_file():
        return "peft"
    if (folder / "model_index.json").is_file() or (folder / DIFFUSERS_LORA).is_file():
        return "diffusers"
    return "transformers"


def pipeline_of(folder: Path, library: str) -> str | None:
    if library == "diffusers":
        return "text-to-image"
    try:
        arch = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("architectures") or [""]
    except (OSError, ValueError, AttributeError):  # an adapter folder has no config.json
        return "text-generation" if library == "peft" else None
    return next((tag for suffix, tag in PIPELINES.items() if str(arch[0]).endswith(suffix)), None)


def base_model(name_or_path: str) -> tuple[str | None, dict[str, Any]]:
    """(the Hub id the trained model descends from, that model's card metadata) where known: a Hub id as given (its
    card read from the local Hub cache only: a run never waits on the network for its card); a local folder's own
    card (its ``base_model`` when it was fine-tuned itself, e.g. an alignkit ``final/``), or the Hub id of a Hub
    cache folder. A local path is never written as ``base_model`` (the Hub would reject it)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        meta = _card_meta(path / CARD)
        cached = CACHE_DIR.search(str(path.resolve()))
        parent = meta.get("base_model")
        hub = f"{cached.group(1)}/{cached.group(2)}" if cached else parent if isinstance(parent, str) else None
        return hub, meta
    if not name_or_path or not HUB_ID.match(name_or_path):
        return None, {}
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name_or_path, CARD)
    except Exception:  # noqa: BLE001 - a card is a courtesy: an odd cache never stops a save
        found = None
    return name_or_path, _card_meta(Path(found)) if isinstance(found, str) else {}


def _card_meta(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        from huggingface_hub import ModelCard

        return ModelCard.load(path, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # noqa: BLE001 - a malformed card of the base model: its license stays unknown
        return {}


def hub_datasets(cfg: dict[str, Any]) -> list[str]:
    """The entries of data.train that are Hub data sets (local files, folders and builtin: sets are not)."""
    names = []
    for spec in cfg.get("data", {}).get("train") or []:
        try:
            if resolve_source(str(spec)).kind == "hub":
                names.append(str(spec))
        except (DataError, OSError):
            continue
    return names


# ---------------------------------------------------------------------------------------- the body
def _intro(algorithm: str, base: str | None, source: str, lora: bool, what: str, role: str | None) -> str:
    start = f"[{base}](https://huggingface.co/{base})" if base and base == source else f"`{source}`"
    if base and base != source:
        start += f" (which descends from [{base}](https://huggingface.co/{base}))"
    kind = "a LoRA adapter on" if lora else "weights fine-tuned from"
    what = what if what.startswith("the ") else f"the {what}"
    who = f" (role `{role}`)" if role else ""
    return f"This folder holds {what}{who} of an alignkit `{algorithm}` run: {kind} {start}."


def _data_section(cfg: dict[str, Any]) -> str:
    data = cfg.get("data", {})
    rows = [f"- train: `{x}`" for x in data.get("train") or []] + [f"- eval: `{x}`" for x in data.get("eval") or []]
    return "## Data\n\n" + "\n".join(rows) if rows else ""


def read_run_metrics(run_dir: Path) -> dict[str, tuple[list[float], list[float]]]:
    """``{metric: (steps, values)}`` from the run's metrics.jsonl; empty without one (logging without jsonl)."""
    try:
        return read_metrics(run_dir / METRICS_FILE).series
    except (DataError, OSError):
        return {}


def best_key(metrics: dict[str, Any]) -> tuple[str, bool] | None:
    """(the eval metric that ranks steps, whether lower is better): eval/loss first, else the first eval metric
    named like a loss (lower) or an accuracy / reward / win rate (higher)."""
    keys = [k for k in metrics if k.startswith("eval/")]
    for key in sorted(keys, key=lambda k: k != "eval/loss"):
        low = key.lower()
        if any(w in low for w in ("loss", "nll", "perplexity")):
            return key, True
        if any(w in low for w in ("acc", "reward", "win", "score")):
            return key, False
    return None


def _metrics_section(metrics: dict[str, tuple[list[float], list[float]]]) -> str:
    """The last training loss; a table of the eval metrics: before training (step 0, where logged), at the end, and
    at the best trained step (by :func:`best_key`; the untrained model is never the best of a run)."""
    evals = {k: dict(zip(*v)) for k, v in metrics.items() if k.startswith("eval/") and v[0]}
    lines = []
    if "loss" in metrics and metrics["loss"][0]:
        lines.append(f"Training loss at the last logged step ({int(metrics['loss'][0][-1])}): "
                     f"{_num(metrics['loss'][1][-1])}.")
    if evals:
        last = max(max(points) for points in evals.values())
        columns: list[tuple[str, float | None]] = [("start (step 0)", 0)] if any(0 in points for points in evals.values()) else []
        columns.append((f"final (step {int(last)})", None))  # each metric's last value
        ranked = best_key(evals)
        if ranked:
            trained = [(v, s) for s, v in evals[ranked[0]].items() if s > 0 and math.isfinite(v)]
            if trained:
                best = (min(trained) if ranked[1] else max(trained))[1]
                columns.append((f"best by `{ranked[0]}` (step {int(best)})", best))
        lines += ["", "| metric | " + " | ".join(name for name, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for key, points in evals.items():
            cells = [points[max(points)] if step is None else points.get(step, math.nan) for _, step in columns]
            lines.append(f"| {key} | " + " | ".join(map(_num, cells)) + " |")
    return "## Results\n\n" + "\n".join(lines).strip() if lines else ""


def _num(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:.4g}"


def _usage(library: str, pipeline: str | None, lora: bool, src: str, base: str) -> str:
    """How to load the folder (``src``: its repo or path; ``base``: what a LoRA adapter goes onto)."""
    if library == "diffusers":
        code = (f'from diffusers import DiffusionPipeline\n\npipe = DiffusionPipeline.from_pretrained("{base}")\n'
                f'pipe.load_lora_weights("{src}")' if lora else
                f'from diffusers import DiffusionPipeline\n\npipe = DiffusionPipeline.from_pretrained("{src}")')
    elif library == "peft" and pipeline == "text-generation":
        code = (f'from peft import AutoPeftModelForCausalLM\n\n'
                f'model = AutoPeftModelForCausalLM.from_pretrained("{src}")  # the base model + this adapter')
    elif library == "transformers" and pipeline in AUTO:
        model, pre = AUTO[pipeline]
        code = (f'from transformers import {model}, {pre}\n\nmodel = {model}.from_pretrained("{src}")\n'
                f'{"processor" if pre == "AutoProcessor" else "tokenizer"} = {pre}.from_pretrained("{src}")')
    else:
        return ""
    return f"## How to use\n\n```python\n{code}\n```"


def _reproduce() -> str:
    ran = "alignkit " + shlex.join(sys.argv[1:]) if sys.argv[1:] else None
    out = ("## Reproduce\n\nWith alignkit installed, the resolved configuration saved beside this card trains the "
           "same model again:\n\n```bash\nalignkit train config.yaml output_dir=runs/again\n```")
    return out + (f"\n\nThe run was started as `{ran}`." if ran else "")


def _versions(library: str) -> str:
    names = ["alignkit", "torch", "transformers"] + ([library] if library in ("peft", "diffusers") else [])
    found = []
    for name in names:
        try:
            found.append(f"- {name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "## Framework versions\n\n" + "\n".join(found)
