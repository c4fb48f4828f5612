"""Model cards and ``hub.push_to_hub`` end to end, from the CLI, with no internet: a fake Hub on 127.0.0.1
(tests/fake_hub.py) records what ``huggingface_hub`` sends; a closed port stands for no network."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import assert_ok, child_env, free_port, run_cli, write_config
from tests.fake_hub import FakeHub

SECRET = "hf_fake_secret_0123456789abcdef"


def _config(sft_config: dict[str, Any], tmp_path: Path, base: Path, **hub: Any) -> Path:
    cfg = dict(sft_config, output_dir=str(tmp_path / "run"), model={"name_or_path": str(base)})
    cfg["data"] = dict(cfg["data"], eval=["builtin:sft_train.jsonl"], max_eval_examples=8, max_train_examples=16)
    cfg["training"] = dict(cfg["training"], eval_steps=2)
    cfg["checkpoint"] = {"save_final": True, "save_each_epoch": True}
    cfg["hub"] = {"push_to_hub": True, "repo_id": "me/tiny-sft", **hub}
    return write_config(tmp_path / "c.yaml", cfg)


def _base_with_card(micro_model: Path, tmp_path: Path) -> Path:
    """The micro model with a card of its own, as a model downloaded from the Hub has: its license and the model
    it came from are what the trained model's card must name."""
    base = Path(shutil.copytree(micro_model, tmp_path / "base"))
    (base / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: org/tiny-base\n---\n# tiny\n")
    return base


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.mark.slow(seconds=30)
def test_card_in_every_model_folder_and_push_to_a_fake_hub(sft_config: dict[str, Any], micro_model: Path,
                                                             tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    base = _base_with_card(micro_model, tmp_path)
    with FakeHub() as hub:
        env = child_env(HF_ENDPOINT=hub.url, HF_TOKEN=SECRET, HF_HOME=str(tmp_path / "hf"))
        # two processes: the card and the push are rank 0's alone (one repo, one commit)
        cfg = _config(sft_config, tmp_path, base, private=True, revision="tiny-run")
        proc = run_cli(["train", str(cfg)], env=env, nproc=2)
    assert_ok(proc)
    final, run = tmp_path / "run" / "final", tmp_path / "run"
    # the card: Hugging Face's header, read back by huggingface_hub itself
    card = ModelCard.load(final / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.base_model == "org/tiny-base" and card.data.license == "apache-2.0"
    assert {"alignkit", "sft"} <= set(card.data.tags)
    assert card.data.datasets is None  # builtin: data, no Hub data set to name
    # its body: the final and best eval metric, the plot (copied beside it), how to rerun, the resolved config
    evals = [r for r in map(yaml.safe_load, (run / "metrics.jsonl").read_text().splitlines()) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    best = min(evals[1:], key=lambda r: r["eval/loss"])  # of the trained steps
    assert (f"| eval/loss | {evals[0]['eval/loss']:.4g} | {evals[-1]['eval/loss']:.4g} | {best['eval/loss']:.4g} |"
            in card.text)
    assert f"best by `eval/loss` (step {best['step']})" in card.text
    assert "![training curves](summary.png)" in card.text
    assert (final / "summary.png").read_bytes() == (run / "plots" / "summary.png").read_bytes()
    assert "alignkit train config.yaml" in card.text and "- alignkit 0.1.0" in card.text
    block = card.text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == yaml.safe_load((final / "config.yaml").read_text())
    # an epoch's folder has its own card (no plot yet when it is saved)
    epoch = ModelCard.load(run / "epoch_1" / "README.md")
    assert "the model of epoch 1" in epoch.text and not (run / "epoch_1" / "summary.png").exists()
    # the push: one private repo, its branch, every file of final/ byte for byte, with the token, which no log shows
    assert hub.repos == [{"name": "tiny-sft", "organization": "me", "visibility": "private"}]
    assert hub.branches == ["me/tiny-sft@tiny-run"]
    assert hub.files == _files(final)
    assert [c["revision"] for c in hub.commits] == ["tiny-run"]
    posts = [r for r in hub.requests if r.method == "POST"]
    assert posts and all(r.headers.get("authorization") == f"Bearer {SECRET}" for r in posts)
    assert f"Pushed {final} to the Hub: {hub.url}/me/tiny-sft/commit/" in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    # the start-up check asked the Hub who the token is ("me", may write to me/): nothing to say
    assert "hub.push_to_hub:" not in proc.stderr and any(r.path == "/api/whoami-v2" for r in hub.requests)


@pytest.mark.slow(seconds=25)
def test_a_push_without_network_or_token_is_one_line_and_the_run_stands(sft_config: dict[str, Any],
                                                                         micro_model: Path, tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the network is down
    cfg = _config(sft_config, tmp_path, micro_model)
    for token, expected, at_start in (
            (SECRET, f"Hub push to me/tiny-sft at {closed} failed (ConnectError: ",
             f"hub.push_to_hub: could not check the token with the Hub at {closed} (ConnectError: "),
            (None, "Hub push skipped: no Hugging Face token (set HF_TOKEN or run `hf auth login`)",
             ("hub.push_to_hub: no Hugging Face token (set HF_TOKEN or run `hf auth login`); training goes on, and "
              "the push of final/ to me/tiny-sft at the end will be skipped"))):
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        env = child_env(HF_ENDPOINT=closed, HF_HOME=str(tmp_path / "hf"))  # an empty HF_HOME: no stored login
        env.pop("HF_TOKEN", None)
        env.pop("HUGGING_FACE_HUB_TOKEN", None)
        if token:
            env["HF_TOKEN"] = token
        # a new interpreter: huggingface_hub reads HF_HOME (where a login's token is) when first imported
        proc = run_cli(["train", str(cfg)], env=env, fresh=token is None)
        assert_ok(proc)
        lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "Hub push" in x]
        assert len(lines) == 1 and lines[0].startswith(expected), lines
        # said at start-up too (issue 50.5: before, only after training), once, before training starts
        log = proc.stderr.splitlines()
        start = [i for i, x in enumerate(log) if x.startswith("hub.push_to_hub:")]
        training = next(i for i, x in enumerate(log) if x.startswith("Training: "))
        assert len(start) == 1 and log[start[0]].startswith(at_start) and start[0] < training, log[start[0]:][:3]
        final = tmp_path / "run" / "final"
        assert lines[0].endswith(f"the model is complete in {final}; upload it later with: hf upload me/tiny-sft {final}")
        assert "Traceback" not in proc.stderr
        assert {"model.safetensors", "config.json", "config.yaml", "README.md", "summary.png"} <= set(_files(final))
        assert (tmp_path / "run" / "plots" / "summary.png").is_file() and (tmp_path / "run" / "epoch_1").is_dir()
        assert "Run finished" in proc.stderr
