"""safe_dpo's bad input: config and model errors (one line each naming the key), the cost-sign check.
The CLI surface and resume are in tests/integration/test_safe_dpo_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignkit.algorithms import ALGORITHMS
from alignkit.algorithms.safe_dpo import check_scalar_model
from alignkit.config import load_config
from alignkit.distributed.env import DistEnv
from alignkit.errors import ConfigError, ModelError
from alignkit.models.loading import load_tokenizer
from tests.conftest import REPO
from tests.safe_dpo_models import make_scorers

ALONE = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)


@pytest.fixture(scope="module")
def scorers(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_scorers(micro_model, tmp_path_factory.mktemp("scorers"))


def overrides(micro_model: Path, scorers: tuple[Path, Path], out: Path) -> list[str]:
    return [f"model.name_or_path={micro_model}", f"safe_dpo.helpful_model={scorers[0]}",
            f"safe_dpo.cost_model={scorers[1]}", f"output_dir={out}", "data.max_train_examples=16",
            "data.max_eval_examples=4", "data.max_length=64", "training.per_device_batch_size=4",
            "training.gradient_accumulation_steps=1", "logging.logging_steps=2", "safe_dpo.cost_eval_every=2",
            "safe_dpo.cost_eval_prompts=2", "safe_dpo.cost_max_new_tokens=6", "training.eval_steps=null",
            "checkpoint.save_steps=4", "logging.report_to=[console,jsonl]", "logging.plot=false",
            "safe_dpo.lambda_lr=0.5", "safe_dpo.threshold=-0.5"]


def test_not_a_scalar_model_is_one_line(micro_model: Path) -> None:
    with pytest.raises(ModelError) as e:
        check_scalar_model(str(micro_model), "safe_dpo.helpful_model")
    assert "safe_dpo.helpful_model" in str(e.value) and "not a reward/cost model" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("over, key", [
    (["safe_dpo.helpful_model="], "safe_dpo.helpful_model"),
    (["safe_dpo.cost_model="], "safe_dpo.cost_model"),
    (["dpo.loss_type=ipo"], "dpo.loss_type"),
    (["safe_dpo.variant=mmdpo"], "mm_dpo"),
    (["safe_dpo.lambda_init=20"], "safe_dpo.lambda_init"),
])
def test_config_errors_name_the_key(micro_model: Path, scorers, tmp_path: Path, over: list[str], key: str) -> None:
    with pytest.raises((ConfigError, KeyError)) as e:
        cfg = load_config(str(REPO / "configs" / "safe_dpo.yaml"), overrides(micro_model, scorers, tmp_path) + over)
        ALGORITHMS.get("safe_dpo").model_specs(cfg)
    assert key in str(e.value)


def test_cost_model_with_the_opposite_sign_is_refused(micro_model: Path, tmp_path: Path) -> None:
    from alignkit.algorithms import workload_of
    from alignkit.algorithms.base import Context
    from alignkit.train.runner import build_models, strategy_for

    flipped = make_scorers(micro_model, tmp_path, flip=True)
    cfg = load_config(str(REPO / "configs" / "safe_dpo.yaml"), overrides(micro_model, flipped, tmp_path / "run")
                      + ["dpo.precompute_ref_logps=false", "safe_dpo.sign_check_rows=64"])
    algo = ALGORITHMS.get("safe_dpo")(cfg, load_tokenizer(cfg.model))
    train = algo.data.build_dataset(["builtin:safety_train.jsonl"], "train")[:64]
    strategy = strategy_for(cfg, ALONE)
    models = build_models(workload_of(cfg), cfg.model, strategy, algo.tokenizer, make_optimizer=None)
    with pytest.raises(ModelError) as e:
        algo.before_training(Context(models, strategy), train, [])
    msg = str(e.value)
    assert "safe_dpo.cost_model" in msg and "opposite sign" in msg and "\n" not in msg


def test_multiplier_window_update_and_state() -> None:
    import math

    from alignkit.algorithms.cost_estimate import prompt_share
    from alignkit.algorithms.lagrange import Multiplier

    m = Multiplier(math.log(1.0), threshold=0.0, lr=0.1, lambda_max=2.0, window=4)
    m.update([1.0, 3.0])  # J_C = 2 -> ln lam = 0 + 0.1 * 1 * 2
    assert m.j_c == 2.0 and m.log_lambda == pytest.approx(0.2)
    m.update([-1.0, -1.0, -1.0])  # window keeps the last 4: [3, -1, -1, -1] -> J_C = 0: no change
    assert list(m.costs) == [3.0, -1.0, -1.0, -1.0] and m.j_c == 0.0 and m.log_lambda == pytest.approx(0.2)
    m.update([-5.0])  # [-1, -1, -1, -5] -> J_C = -2: lambda falls
    assert m.value < math.exp(0.2)
    for _ in range(50):
        m.update([10.0])
    assert m.value == pytest.approx(2.0)  # clamped at lambda_max
    again = Multiplier(0.0, 0.0, 0.1, 2.0, 4)
    again.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert again.state_dict() == m.state_dict()
    shares = [prompt_share(10, 5, 1, r, 2) for r in range(2)]
    assert shares == [[6, 7, 8], [9, 0, 1]]  # ceil(5/2) each, walking on from estimate 0's [0..5]


def test_required_keys_alone_give_the_shipped_recipe(micro_model: Path, scorers, tmp_path: Path) -> None:
    """``algorithm: safe_dpo`` with only the required keys trains what configs/safe_dpo.yaml trains (the RPO
    term on the safer response and the PID dual included); ``safe_dpo.safe_nll_coeff=0`` is the seed guides'
    plain loss and ``safe_dpo.lambda_update=gradient`` their dual rule."""
    from alignkit.algorithms.safe_dpo import SafeDPOConfig

    minimal = tmp_path / "minimal.yaml"
    minimal.write_text(f"algorithm: safe_dpo\nmodel: {{name_or_path: {micro_model}}}\n"
                       f"data: {{train: builtin:safety_train.jsonl}}\ntraining: {{per_device_batch_size: 4}}\n"
                       f"safe_dpo: {{helpful_model: {scorers[0]}, cost_model: {scorers[1]}}}\n")
    shipped = load_config(str(REPO / "configs" / "safe_dpo.yaml"), overrides(micro_model, scorers, tmp_path))
    keys = ("safe_nll_coeff", "lambda_update", "pid_kp", "pid_ki", "pid_kd", "cost_margin", "cost_window", "variant")
    for cfg in (load_config(str(minimal), []), shipped):
        s = cfg.section(SafeDPOConfig)
        assert tuple(getattr(s, k) for k in keys) == (1.0, "pid", 0.0, 0.01, 0.5, 2.0, 16, "mm_dpo")
    plain = load_config(str(minimal), ["safe_dpo.safe_nll_coeff=0", "safe_dpo.lambda_update=gradient"])
    assert plain.section(SafeDPOConfig).safe_nll_coeff == 0.0  # the seed guides' loss and dual rule, by key
    assert plain.section(SafeDPOConfig).lambda_update == "gradient"
