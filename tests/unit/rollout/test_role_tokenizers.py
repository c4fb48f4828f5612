"""Per-role tokenizers: a frozen scorer keeps the tokenizer saved with it, and an online scorer whose
vocabulary differs from the policy's scores the decoded text re-encoded with its own tokenizer (the
policy's token ids would index another vocabulary); with the same vocabulary it reads the ids."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from alignkit.config.schema import DataConfig, ModelConfig
from alignkit.data.io import Row
from alignkit.data.prompts import PromptData
from alignkit.models.loading import load_tokenizer
from alignkit.models.roles import Models, ModelSpec, build_model, role_tokenizer, same_vocabulary
from alignkit.rewards.scalar import score_responses
from alignkit.rewards.signals import ScoreInputs, Signal
from alignkit.rollout.experience import collate_samples

CPU = SimpleNamespace(autocast=contextlib.nullcontext, device=torch.device("cpu"))
PROMPTS = ["What is 2+3?", "Reverse the letters of cat."]
COMPLETIONS = ["The answer is 5.", "tac"]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from alignkit.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("other") / "m", size="micro", vocab_size=320, seed=1)


def scorer_bundle(policy_dir: Path, scorer_dir: Path) -> tuple[Models, ScoreInputs]:
    policy_tok = load_tokenizer(ModelConfig(name_or_path=str(policy_dir)))
    spec = ModelSpec("reward", str(scorer_dir), "scalar")
    scorer_tok = role_tokenizer(spec, policy_tok, ModelConfig(name_or_path=str(policy_dir)))
    module = build_model(spec, ModelConfig(name_or_path=str(scorer_dir)), torch.float32, scorer_tok).eval()
    models = Models(frozen={"reward": module}, specs={"reward": spec},
                    tokenizers={"policy": policy_tok, "reward": scorer_tok})
    data = PromptData(policy_tok, DataConfig(chat_template=True, max_length=64), max_new_tokens=8)
    rows = [data.convert(Row({"prompt": p}, "p.jsonl", i + 1)) for i, p in enumerate(PROMPTS)]
    samples = [{"prompt_ids": r["prompt_ids"], "completion_ids": policy_tok(c, add_special_tokens=False)["input_ids"]}
               for r, c in zip(rows, COMPLETIONS)]
    batch = collate_samples(samples, policy_tok.pad_token_id)
    return models, ScoreInputs(PROMPTS, COMPLETIONS, [len(s["completion_ids"]) for s in samples], [{}, {}], [batch])


def test_a_scorer_with_another_vocabulary_re_encodes_the_text(micro_model: Path, other_model: Path) -> None:
    models, inputs = scorer_bundle(micro_model, other_model)
    mine, policy = models.tokenizer("reward"), models.tokenizer("policy")
    assert not same_vocabulary(mine, policy) and len(mine) < len(policy)  # its own, saved with it
    assert max(int(inputs.batches[0]["input_ids"].max()), 0) >= len(mine)  # policy ids beyond its vocabulary
    got = Signal("reward", [], model_role="reward", chat_template=True, max_length=64).score(models, inputs, CPU)
    want = score_responses(models["reward"], mine, PROMPTS, COMPLETIONS, chat_template=True, max_length=64,
                           device=CPU.device)
    assert got["model"] == pytest.approx(want.tolist(), abs=1e-6) and got["total"] == got["model"]


def test_the_same_vocabulary_reads_the_policys_ids(micro_model: Path) -> None:
    models, inputs = scorer_bundle(micro_model, micro_model)
    assert same_vocabulary(models.tokenizer("reward"), models.tokenizer("policy"))
    got = Signal("reward", [], model_role="reward").score(models, inputs, CPU)
    with torch.no_grad():
        assert got["model"] == pytest.approx(models.scores("reward", inputs.batches[0]).tolist(), abs=1e-6)


def test_roles_on_the_policys_ids_keep_the_run_tokenizer(micro_model: Path, other_model: Path) -> None:
    run = load_tokenizer(ModelConfig(name_or_path=str(micro_model)))
    cfg = ModelConfig(name_or_path=str(micro_model))
    assert role_tokenizer(ModelSpec("value", str(other_model), "scalar", trainable=True), run, cfg) is run
    assert role_tokenizer(ModelSpec("reference", str(other_model), "lm"), run, cfg) is run
    assert len(role_tokenizer(ModelSpec("target", str(other_model), "lm"), run, cfg)) == len(
        load_tokenizer(ModelConfig(name_or_path=str(other_model))))


def test_a_role_is_any_name_an_algorithm_declares() -> None:
    """Roles are open (a plugin algorithm names its own, as tests/plugins/judged_grpo.py's ``judge``); a malformed
    name is one line at the spec, and a role the run did not declare is one line naming the declared ones."""
    from torch import nn

    assert ModelSpec("judge", "somewhere").role == "judge"
    with pytest.raises(ValueError, match="ModelSpec.role must be a name") as err:
        ModelSpec("my judge", "somewhere")
    assert "\n" not in str(err.value)
    models = Models(frozen={"judge": nn.Identity()}, specs={"judge": ModelSpec("judge", "somewhere")})
    assert isinstance(models["judge"], nn.Identity)
    with pytest.raises(KeyError, match=r"no model with role 'critic' in this run \(have \['judge'\]\)"):
        models["critic"]
