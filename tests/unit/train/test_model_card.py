"""The model card's pieces (header fields, the best eval step, masked secrets) and the ``hub:`` section's checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from alignkit.config import load_config
from alignkit.errors import ConfigError
from alignkit.train.model_card import base_model, write_model_card

BASE = {"algorithm": "sft", "model": {"name_or_path": "m"}, "data": {"train": ["builtin:sft_train.jsonl"]},
        "training": {"per_device_batch_size": 1}}


def _card(folder: Path, cfg: dict[str, Any], rows: list[dict[str, Any]] = ()) -> Any:
    from huggingface_hub import ModelCard

    run = folder.parent
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ModelCard.load(write_model_card(folder, yaml.safe_dump(cfg), run))


def test_adapter_card_names_peft_the_hub_base_and_only_hub_datasets(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "final"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    local = tmp_path / "rows.jsonl"
    local.write_text("{}\n")
    cfg = {"algorithm": "dpo", "model": {"name_or_path": "Org/Base-1B"},
           "data": {"train": ["org/prefs", "builtin:dpo_train.jsonl", str(local)]},
           "logging": {"wandb_api_key": "sk-very-secret"}}
    card = _card(folder, cfg, [{"step": 1, "loss": 0.5}])
    assert card.data.library_name == "peft" and card.data.base_model == "Org/Base-1B"
    assert card.data.datasets == ["org/prefs"] and {"alignkit", "dpo", "lora"} <= set(card.data.tags)
    assert "AutoPeftModelForCausalLM" in card.text and "[Org/Base-1B](https://huggingface.co/Org/Base-1B)" in card.text
    assert "sk-very-secret" not in card.text and "wandb_api_key: '***'" in card.text
    assert "Training loss at the last logged step (1): 0.5." in card.text


def test_diffusers_lora_card_loads_onto_its_base(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "final_image_policy"
    folder.mkdir(parents=True)
    (folder / "pytorch_lora_weights.safetensors").write_bytes(b"")  # what diffusers' save_lora_weights writes
    cfg = {"algorithm": "flow_rtpo", "model": {"name_or_path": "org/attacker"}, "data": {"train": []}}
    from huggingface_hub import ModelCard

    card = ModelCard.load(write_model_card(folder, yaml.safe_dump(cfg), tmp_path / "run", source="org/sd3",
                                           role="image_policy"))
    assert (card.data.library_name, card.data.pipeline_tag, card.data.base_model) == ("diffusers", "text-to-image",
                                                                                      "org/sd3")
    assert "lora" in card.data.tags and "(role `image_policy`)" in card.text
    assert 'DiffusionPipeline.from_pretrained("org/sd3")\npipe.load_lora_weights(' in card.text


def test_best_step_follows_each_metric_direction(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "final"
    folder.mkdir(parents=True)
    rows = [{"step": 0, "eval/loss": 3.0, "eval/accuracy": 0.5}, {"step": 5, "eval/loss": 1.0, "eval/accuracy": 0.7},
            {"step": 9, "eval/loss": 2.0, "eval/accuracy": 0.9}]
    text = _card(folder, BASE, rows).text
    assert "| metric | start (step 0) | final (step 9) | best by `eval/loss` (step 5) |" in text
    assert "| eval/loss | 3 | 2 | 1 |" in text and "| eval/accuracy | 0.5 | 0.9 | 0.7 |" in text
    # no loss logged: the accuracy ranks the steps, higher first
    text = _card(folder, BASE, [{k: v for k, v in r.items() if k != "eval/loss"} for r in rows]).text
    assert "best by `eval/accuracy` (step 9)" in text and "| eval/accuracy | 0.5 | 0.9 | 0.9 |" in text
    # the untrained model (step 0) is never the best step, even where training made things worse
    text = _card(folder, BASE, [{"step": 0, "eval/loss": 0.5}, {"step": 4, "eval/loss": 0.9},
                                {"step": 8, "eval/loss": 0.7}]).text
    assert "best by `eval/loss` (step 8)" in text and "| eval/loss | 0.5 | 0.7 | 0.7 |" in text
    # no metrics.jsonl (logging without jsonl): no results section, still a card
    (tmp_path / "run" / "metrics.jsonl").unlink()
    assert "## Results" not in write_model_card(folder, yaml.safe_dump(BASE), tmp_path / "run").read_text()


def test_base_model_of_a_local_folder(tmp_path: Path) -> None:
    cache = tmp_path / "hub" / "models--Org--Model-7B" / "snapshots" / "abc123"
    cache.mkdir(parents=True)
    assert base_model(str(cache)) == ("Org/Model-7B", {})
    plain = tmp_path / "my-model"
    plain.mkdir()
    assert base_model(str(plain)) == (None, {})  # a local path is never a base_model
    (plain / "README.md").write_text("---\nlicense: mit\nbase_model: org/origin\n---\n")
    hub, meta = base_model(str(plain))
    assert hub == "org/origin" and meta["license"] == "mit"
    assert base_model("not a hub id!") == (None, {})


@pytest.mark.parametrize(("overrides", "message"), [
    (["hub.push_to_hub=true"], "hub.repo_id: required when hub.push_to_hub is true"),
    (["hub.repo_id=a/b/c"], "hub.repo_id: Repo id must be in the form 'repo_name' or 'namespace/repo_name'"),
    (["hub.push_to_hub=true", "hub.repo_id=me/x", "checkpoint.save_final=false"],
     "hub.push_to_hub: needs checkpoint.save_final=true"),
])
def test_hub_section_bad_input_is_one_line(tmp_path: Path, overrides: list[str], message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_push_without_a_token_sends_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    from alignkit.config.schema import HubConfig
    from alignkit.train import hub_push

    lines: list[str] = []
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda **_: pytest.fail("no request without a token"))
    log = type("Log", (), {"info": staticmethod(lines.append)})()
    hub = HubConfig(push_to_hub=True, repo_id="me/x", private=True)
    assert hub_push.push_final(tmp_path, hub, log, algorithm="sft") is None
    assert lines == [(f"Hub push skipped: no Hugging Face token (set HF_TOKEN or run `hf auth login`); the model is "
                      f"complete in {tmp_path}; upload it later with: hf upload me/x {tmp_path} --private")]


def test_the_pushed_config_has_its_secrets_masked_and_the_local_one_stays_whole(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from alignkit.config.schema import HubConfig
    from alignkit.train.hub_push import push_final
    from tests.fake_hub import FakeHub

    final = tmp_path / "run" / "final"
    (final / "image_policy").mkdir(parents=True)
    cfg = {"algorithm": "sft", "my_plugin": {"api_key": "sk-live-123", "max_new_tokens": 8}}
    (final / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (final / "model.safetensors").write_bytes(b"\x00weights")
    (final / "image_policy" / "config.json").write_text("{}")
    local = (final / "config.yaml").read_bytes()
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_0123456789")
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        url = push_final(final, HubConfig(push_to_hub=True, repo_id="me/m"), _QuietLog(), algorithm="sft")
    assert url and url.startswith(hub.url)
    assert len(hub.commits) == 1  # one commit, every file in it
    assert set(hub.files) == {"config.yaml", "model.safetensors", "image_policy/config.json"}
    assert hub.files["model.safetensors"] == b"\x00weights"
    assert yaml.safe_load(hub.files["config.yaml"]) == {"algorithm": "sft",
                                                        "my_plugin": {"api_key": "***", "max_new_tokens": 8}}
    assert b"sk-live-123" not in b"".join(hub.files.values())
    assert (final / "config.yaml").read_bytes() == local  # the run's own copy: whole, for resume and reruns


class _QuietLog:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)


@pytest.mark.parametrize("whoami, token, expected", [
    (None, None, ("hub.push_to_hub: no Hugging Face token (set HF_TOKEN or run `hf auth login`); training goes on, "
                  "and the push of final/ to me/m at the end will be skipped")),
    ({"name": "me", "orgs": [], "auth": {"accessToken": {"role": "read"}}}, "hf_t",
     "hub.push_to_hub: the token of me is read-only; the push of final/ to me/m at the end will fail"),
    ({"name": "you", "orgs": [{"name": "lab"}], "auth": {"accessToken": {"role": "write"}}}, "hf_t",
     ("hub.push_to_hub: the token is you's, who is not a member of 'me' (organisations: lab); the push to me/m "
      "at the end will likely be refused")),
    ({"name": "you", "orgs": [{"name": "me"}], "auth": {"accessToken": {"role": "write"}}}, "hf_t", None),
    ({"name": "me", "orgs": [], "auth": {"accessToken": {"role": "write"}}}, "hf_t", None),
])
def test_the_push_is_checked_at_start_up(monkeypatch: pytest.MonkeyPatch, whoami: dict | None, token: str | None,
                                         expected: str | None) -> None:
    """Issue 50.5: before, a push that could not work was only reported after training. The check asks the Hub who
    the token is (``whoami``) and sends nothing else."""
    import huggingface_hub

    from alignkit.config.schema import HubConfig
    from alignkit.train.hub_push import check_at_start
    from tests.fake_hub import FakeHub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: token)
    log = _QuietLog()
    with FakeHub() as hub:
        if whoami is not None:
            hub.whoami = whoami
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        check_at_start(HubConfig(push_to_hub=True, repo_id="me/m"), log)
    assert log.lines == ([expected] if expected else [])
    asked = [r for r in hub.requests if r.path == "/api/whoami-v2"]
    assert len(asked) == (1 if token else 0) and all(r.method == "GET" for r in hub.requests)


def test_the_start_up_check_without_network_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from alignkit.config.schema import HubConfig
    from alignkit.train.hub_push import check_at_start
    from tests.conftest import free_port

    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", closed)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_0123456789")
    log = _QuietLog()
    check_at_start(HubConfig(push_to_hub=True, repo_id="me/m"), log)
    assert len(log.lines) == 1 and log.lines[0].startswith(
        f"hub.push_to_hub: could not check the token with the Hub at {closed} (ConnectError: "), log.lines
    assert log.lines[0].endswith("; the push is tried at the end of the run")
    check_at_start(HubConfig(push_to_hub=False), log)  # no push: no check
    assert len(log.lines) == 1
