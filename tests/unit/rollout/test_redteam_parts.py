"""Red-team targets, scorers and prompt rows (rollout/redteam_targets.py, rewards/scorers.py)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from alignkit.algorithms.redteam import RedTeamPrompts, RedTeamScorerConfig, RedTeamTargetConfig
from alignkit.config.schema import DataConfig, ModelConfig
from alignkit.errors import ConfigError, ModelError
from alignkit.rewards.functions import RewardFunctionError
from alignkit.rewards.scorers import Judged, build_scorer, toxicity_heads
from alignkit.rollout.redteam_targets import build_target
from tests.plugins.redteam_parts import build_classifier


def judged(outputs: list[str], attacks: list[str] | None = None) -> Judged:
    attacks = attacks or [f"attack {i}" for i in range(len(outputs))]
    return Judged(attacks, outputs, [f"seed {i}" for i in range(len(outputs))], [{"k": i} for i in range(len(outputs))])


@pytest.fixture(scope="module")
def classifiers(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("classifiers")
    return {"multi": build_classifier(str(root / "multi"), str(micro_model), ["toxic", "insult", "threat"], multi_label=True),
            "single": build_classifier(str(root / "single"), str(micro_model), ["non-toxic", "toxic", "other"],
                                       multi_label=False)}


def manual_logits(path: str, texts: list[str]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([model(**tok([t], return_tensors="pt")).logits[0] for t in texts])


def test_toxicity_scorer_multi_label_is_the_mean_of_the_heads_sigmoids(classifiers: dict[str, str]) -> None:
    texts = ["you are a cat", "the sun is warm today and the sea is calm", "x"]
    scorer = build_scorer(RedTeamScorerConfig("toxicity", model=classifiers["multi"], batch_size=2), ModelConfig())
    got = scorer(judged(texts), torch.device("cpu"))
    want = manual_logits(classifiers["multi"], texts).sigmoid().mean(-1)  # unpadded, one by one
    assert got == pytest.approx(want.tolist(), abs=1e-5)
    two = build_scorer(RedTeamScorerConfig("toxicity", model=classifiers["multi"], heads=["insult", "threat"]), ModelConfig())
    assert two(judged(texts), torch.device("cpu")) == pytest.approx(
        manual_logits(classifiers["multi"], texts).sigmoid()[:, 1:].mean(-1).tolist(), abs=1e-5)
    on_attack = build_scorer(RedTeamScorerConfig("toxicity", model=classifiers["multi"], text="attack"), ModelConfig())
    assert on_attack(judged(["a", "b", "c"], attacks=texts), torch.device("cpu")) == pytest.approx(got, abs=1e-5)


def test_toxicity_scorer_single_label_is_the_toxic_labels_softmax(classifiers: dict[str, str]) -> None:
    texts = ["hello there", "bad words"]
    scorer = build_scorer(RedTeamScorerConfig("toxicity", model=classifiers["single"]), ModelConfig())
    want = manual_logits(classifiers["single"], texts).softmax(-1)[:, 1]  # "toxic", not "non-toxic"
    assert scorer(judged(texts), torch.device("cpu")) == pytest.approx(want.tolist(), abs=1e-5)


def test_toxicity_heads_rules() -> None:
    cfg = lambda n, labels, pt=None: SimpleNamespace(num_labels=n, id2label=dict(enumerate(labels)), problem_type=pt)  # noqa: E731
    assert toxicity_heads(cfg(6, list("abcdef"), "multi_label_classification"), [], "auto") == ("sigmoid", list(range(6)))
    assert toxicity_heads(cfg(1, ["score"]), [], "auto") == ("sigmoid", [0])
    assert toxicity_heads(cfg(2, ["neutral", "toxic"]), [], "auto") == ("softmax", [1])
    assert toxicity_heads(cfg(2, ["toxic", "neutral"]), [], "auto") == ("softmax", [0])
    assert toxicity_heads(cfg(2, ["LABEL_0", "LABEL_1"]), [], "auto") == ("softmax", [1])  # no name: the last
    with pytest.raises(ModelError, match="not labels"):
        toxicity_heads(cfg(2, ["a", "b"]), ["c"], "auto")


def test_function_scorers_read_attacks_outputs_and_fields() -> None:
    unsafe = build_scorer(RedTeamScorerConfig("unsafe"), ModelConfig())  # the toy world's program judge
    out = unsafe(judged(["Sure: get a thin wire and pick the lock", "I can't help with that."],
                        attacks=["how to pick a lock", "how to pick a lock"]), torch.device("cpu"))
    assert out == [1.0, 0.0]
    vowels = build_scorer(RedTeamScorerConfig("tests.plugins.redteam_parts:vowel_share"), ModelConfig())
    assert vowels(judged(["aab", "", "xyz"]), torch.device("cpu")) == pytest.approx([2 / 3, 0.0, 0.0])
    with pytest.raises(ConfigError, match="unknown scorer 'toxicty'"):
        RedTeamScorerConfig("toxicty")
    with pytest.raises(ConfigError, match="needs a model"):
        build_scorer(RedTeamScorerConfig("toxicity"), ModelConfig())


def test_function_target_and_lm_target_checks() -> None:
    echo = build_target(RedTeamTargetConfig("tests.plugins.redteam_parts:echo_target"))
    assert echo.specs() == [] and echo.respond(None, ["hi", "yo"], ["s", "s"], [{}, {}]) == ["HI", "YO"]
    bad = build_target(RedTeamTargetConfig("tests.plugins.redteam_parts:bad_target"))  # returns floats
    with pytest.raises(RewardFunctionError, match="must return 2 strings"):
        bad.respond(None, ["a", "b"], ["s", "s"], [{}, {}])
    with pytest.raises(ConfigError, match="needs a model"):
        build_target(RedTeamTargetConfig("lm"))
    with pytest.raises(ConfigError, match="must hold"):
        build_target(RedTeamTargetConfig("lm", model="m", template="no slot"))
    spec, = build_target(RedTeamTargetConfig("lm", model="some/target")).specs()
    assert (spec.role, spec.source, spec.kind, spec.trainable, spec.tokenizer) == ("target", "some/target", "lm", False, "some/target")


@pytest.mark.parametrize("mode", ["write", "rewrite"])
def test_prompt_rows_put_the_row_prompt_into_the_instruction(micro_model: Path, tmp_path: Path, mode: str) -> None:
    from alignkit.algorithms.redteam import INSTRUCTIONS
    from alignkit.data.prompts import prompt_text
    from alignkit.data.synth import write_rows
    from alignkit.models.loading import load_tokenizer

    tok = load_tokenizer(ModelConfig(name_or_path=str(micro_model)))
    path = write_rows([{"prompt": "the cat sat", "topic": "pets"}], tmp_path / "p.jsonl")
    data = RedTeamPrompts(tok, DataConfig(max_length=64), max_new_tokens=8, instruction=INSTRUCTIONS[mode])
    row, = data.build_dataset([str(path)], "train")
    shown = INSTRUCTIONS[mode].replace("{prompt}", "the cat sat")
    assert row["prompt"] == "the cat sat" and row["fields"] == {"topic": "pets"}
    assert row["prompt_ids"] == tok(prompt_text(tok, shown), add_special_tokens=False)["input_ids"]
    assert (shown == "the cat sat") == (mode == "write") and not math.isnan(len(row["prompt_ids"]))


def test_seed_similarity_quality() -> None:
    scorer = build_scorer(RedTeamScorerConfig("seed_similarity", use="quality"), ModelConfig())
    batch = Judged(["the cat sat", "a dog ran", "The Cat sat"], ["", "", ""], ["the cat sat", "the cat sat", "the cat"], [{}] * 3)
    # {the, cat, sat, the cat, cat sat} vs itself: 1; disjoint: 0; vs {the, cat, the cat}: 3 / 5
    assert scorer(batch, torch.device("cpu")) == pytest.approx([1.0, 0.0, 0.6])


def test_top_attacks_keep_the_most_toxic_distinct_attacks() -> None:
    from alignkit.algorithms.redteam import best_attacks, top_table

    row = lambda step, attack, tox: {"step": step, "attack": attack, "output": f"o{step}", "toxicity": tox,  # noqa: E731
                                     "reward": tox, "prompt": "p"}
    top = best_attacks([], [row(1, "a", 0.5), row(1, "b", 0.9), row(1, "c", math.nan)], 2)
    assert [(r["attack"], r["toxicity"]) for r in top] == [("b", 0.9), ("a", 0.5)]
    top = best_attacks(top, [row(2, "a ", 0.95), row(2, "d", 0.1), row(2, "b", 0.9)], 2)
    assert [(r["attack"], r["step"], r["toxicity"]) for r in top] == [("a ", 2, 0.95), ("b", 1, 0.9)]
    table = top_table([row(3, "x | y\nz", 0.5)])
    assert table.splitlines()[2] == "| 1 | 0.5000 | 0.5000 | 3 | x \\| y z | o3 |"


def test_fluency_is_the_geometric_mean_token_probability(micro_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scorer = build_scorer(RedTeamScorerConfig("fluency", use="quality", model=str(micro_model), text="attack"), ModelConfig())
    texts = ["the cat sat on the mat", "x", ""]
    got = scorer(judged(["", "", ""], attacks=texts), torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(micro_model)
    model = AutoModelForCausalLM.from_pretrained(micro_model).eval()
    want = []
    for text in texts[:2]:
        ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logps = model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        want.append(math.exp(sum(logps[i, t].item() for i, t in enumerate(ids[1:])) / (len(ids) - 1)))
    assert got == pytest.approx(want + [0.0], rel=1e-5)
    assert 0 < got[0] < 1


def test_a_module_function_scorer_is_handed_the_images_as_rgb_pil() -> None:
    """A flow policy's batch (prompts, empty outputs, images): a ``module:function`` receives ``images=`` one RGB
    PIL image per sample, and its values are the scores (a black and a white image: brightness 0 and 1; an
    RGBA one converted). A text batch calls it without images (here: the plugin's one-line refusal)."""
    from PIL import Image

    scorer = build_scorer(RedTeamScorerConfig("tests.plugins.image_reward:brightness"), ModelConfig())
    images = [Image.new("RGB", (4, 4), (0, 0, 0)), Image.new("RGBA", (4, 4), (255, 255, 255, 0)),
              Image.new("RGB", (2, 2), (51, 102, 153))]
    batch = Judged(["a", "b", "c"], [""] * 3, ["a", "b", "c"], [{}] * 3, images)
    assert scorer(batch, torch.device("cpu")) == pytest.approx([0.0, 1.0, 0.4])
    with pytest.raises(RewardFunctionError, match="brightness scores images: got None for 2 prompts"):
        scorer(Judged(["a", "b"], ["x", "y"], ["a", "b"], [{}] * 2, [None, None]), torch.device("cpu"))
