"""The pure parts of ``rollout.placement: separate``: how an iteration's completions split between generators and
trainers, the staleness tags and the drop rule, the weight buckets, the config's cross-field checks and what the
placement refuses (one line each)."""

from __future__ import annotations

import pytest
import torch

from alignkit.config import load_config
from alignkit.distributed.placement import _buckets
from alignkit.errors import ConfigError
from alignkit.metrics import MetricSums
from alignkit.rollout.remote import generator_parts, keep_behaviour_logps, tag_staleness


def test_each_trainer_gets_its_slice_from_the_generators_that_sampled_it() -> None:
    # 12 completions, 2 generators (0..5, 6..11), 3 trainers (0..3, 4..7, 8..11)
    parts = generator_parts(12, 2, 3)
    assert parts == [[(0, 4), (4, 6), (8, 8)], [(6, 6), (6, 8), (8, 12)]]  # (a, a): no share
    for t, want in enumerate([(0, 4), (4, 8), (8, 12)]):  # the pieces of trainer t, in generator order, tile it
        got = [i for g in parts for i in range(*g[t])]
        assert got == list(range(*want))
    assert generator_parts(8, 1, 1) == [[(0, 8)]]


def test_staleness_tags_drops_and_counts() -> None:
    samples = [{"id": i} for i in range(5)]
    stats = MetricSums()
    kept = tag_staleness(samples, [5, 5, 4, 3, 1], version=5, max_staleness=2, stats=stats)
    assert [s["id"] for s in kept] == [0, 1, 2, 3]  # 5 - 1 = 4 > 2: dropped
    assert [s["staleness"] for s in samples] == [0, 0, 1, 2, 4] and samples[4]["policy_version"] == 1
    m = stats.means()
    assert m["staleness/mean"] == pytest.approx(7 / 5) and m["staleness/max"] == 4.0
    assert (m["staleness/0"], m["staleness/1"], m["staleness/2"], m["staleness/3"]) == (2.0, 1.0, 1.0, 1.0)
    assert m["staleness/dropped"] == 1.0  # staleness/3: the samples older than the bound, all dropped


def test_behaviour_logps_fill_only_what_the_rollout_left_empty() -> None:
    samples = [{"sampler_logps": [-0.5]}, {}]
    keep_behaviour_logps(samples, [[-1.0], [-2.0, -3.0]])
    assert samples == [{"sampler_logps": [-0.5]}, {"sampler_logps": [-2.0, -3.0]}]
    keep_behaviour_logps(samples, None)  # the generators sent none: nothing changes


def test_weight_buckets_keep_one_dtype_and_a_size_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    import alignkit.distributed.placement as placement

    monkeypatch.setattr(placement, "BUCKET_BYTES", 100)
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(40), torch.zeros(3, dtype=torch.float64), torch.zeros(2)]
    # 40 + 40 bytes fit; 160 alone (larger than a bucket); a dtype change starts a bucket
    assert list(_buckets(ts)) == [[0, 1], [2], [3], [4]]
    # bf16 travels as fp32 (40 bytes each: one bucket with an fp32 tensor); a ZeRO-3 parameter counts its full size
    zero3 = torch.nn.Parameter(torch.zeros(0))
    zero3.ds_numel = 20  # 80 bytes: with the 40 before it, over the bound
    ts = [torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10), zero3]
    assert list(_buckets(ts)) == [[0, 1], [2]]


def test_what_a_version_sends_and_the_base_check() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from alignkit.distributed.placement import frozen_tensors, sync_tensors

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    whole = sync_tensors(base, lora=False)
    assert len(whole) == len(list(base.parameters())) + len(list(base.buffers()))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    adapters = sync_tensors(model, lora=True)
    # q and v of the one layer, A and B each: 4 tensors, 2 x (2 x 16 + 16 x 2) = 128 numbers
    assert len(adapters) == 4 and sum(t.numel() for t in adapters) == 128
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("lora_" in names[id(t)] for t in adapters)
    assert all("lora_" not in names[id(t)] for t in frozen_tensors(model)) and frozen_tensors(model)


def test_config_cross_checks() -> None:
    base = ["algorithm=grpo", "model.name_or_path=x", "data.train=x.jsonl", "training.per_device_batch_size=8"]
    assert load_config(None, [*base, "rollout.placement=separate", "rollout.max_staleness=2"]).rollout.max_staleness == 2
    with pytest.raises(ConfigError, match="needs rollout.placement: separate"):
        load_config(None, [*base, "rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match="rollout.placement"):
        load_config(None, [*base, "rollout.placement=elsewhere"])
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(None, [*base, "rollout.placement=separate", "rollout.max_staleness=-1"])


@pytest.mark.parametrize(("overrides", "why"), [
    (["algorithm=redteam", "redteam.target.model=x"], "rollout of its own"),
    (["model.kind=vlm"], "kind lm"),
])
def test_what_separate_refuses(overrides: list[str], why: str) -> None:
    from alignkit.algorithms import ALGORITHMS, workload_of
    from alignkit.train.generator_loop import check_separate

    cfg = load_config(None, ["algorithm=grpo", "model.name_or_path=x", "data.train=x.jsonl", "training.per_device_batch_size=8", "rollout.placement=separate", *overrides])
    with pytest.raises(ConfigError, match=why):
        check_separate(cfg, ALGORITHMS.get(cfg.algorithm), workload_of(cfg), cfg.distributed.strategy, 1, 8)
    ok = load_config(None, ["algorithm=grpo", "model.name_or_path=x", "data.train=x.jsonl", "training.per_device_batch_size=8", "rollout.placement=separate"])
    check_separate(ok, ALGORITHMS.get("grpo"), workload_of(ok), "ddp", 2, 8)
    lora = load_config(None, ["algorithm=grpo", "model.name_or_path=x", "data.train=x.jsonl", "training.per_device_batch_size=8", "rollout.placement=separate", "model.lora={r: 4}"])
    for strategy in ("single", "fsdp", "deepspeed"):  # LoRA (its adapters travel) and the FSDP2 trainers (gathered in buckets)
        check_separate(lora, ALGORITHMS.get("grpo"), workload_of(lora), strategy, 1, 8)
    with pytest.raises(ConfigError, match="split evenly"):
        check_separate(ok, ALGORITHMS.get("grpo"), workload_of(ok), "ddp", 3, 8)


def test_validate_and_launch_count_the_trainers_only() -> None:
    from alignkit.train.generator_loop import trainer_processes

    base = ["model.name_or_path=x", "data.train=x.jsonl", "training.per_device_batch_size=8"]
    separate = load_config(None, ["algorithm=grpo", *base, "rollout.placement=separate", "rollout.generator_processes=2"])
    assert trainer_processes(separate, 5) == 3
    assert trainer_processes(load_config(None, ["algorithm=grpo", *base]), 5) == 5
    assert trainer_processes(load_config(None, ["algorithm=sft", *base]), 5) == 5


def test_separate_splits_grpo_agent_and_refuses_what_is_not_split() -> None:
    from alignkit.algorithms import ALGORITHMS, workload_of
    from alignkit.train.generator_loop import check_separate

    base = ["model.name_or_path=x", "data.train=x.jsonl", "training.per_device_batch_size=8", "rollout.placement=separate"]
    agent = load_config(None, ["algorithm=grpo_agent", *base])
    assert ALGORITHMS.get("grpo_agent").split_rollout(agent) == "items"
    check_separate(agent, ALGORITHMS.get("grpo_agent"), workload_of(agent), "ddp", 1, 8)
    dapo = load_config(None, ["algorithm=grpo", *base, "grpo.dynamic_sampling=true"])
    assert ALGORITHMS.get("grpo").split_rollout(dapo) is None
    with pytest.raises(ConfigError, match="not red teaming, flow, dynamic sampling"):
        check_separate(dapo, ALGORITHMS.get("grpo"), workload_of(dapo), "ddp", 1, 8)


def test_a_trainer_takes_the_generators_function_scores() -> None:
    """A generator's delivery cut per trainer, and the scores it carries give the total the trainer would have
    computed itself: by hand, weights 0.5 (length: words) and 2.0 (a constant 1), minus length_penalty 0.1 x
    tokens / max_new_tokens 10."""
    from alignkit.rewards.signals import ScoreInputs, Signal
    from alignkit.rollout.remote import Delivery

    one = f"{__name__}:constant_one"
    functions = [type("F", (), {"name": "length", "weight": 0.5}), type("F", (), {"name": one, "weight": 2.0})]
    signal = Signal("reward", functions, length_penalty=0.1, max_new_tokens=10)
    inputs = ScoreInputs(["p"] * 3, ["a b", "a b c d", ""], [2, 5, 0], [{}] * 3, [])
    made = signal.function_scores(inputs)  # on the generator
    assert made == {"length": [2.0, 4.0, 0.0], one: [1.0, 1.0, 1.0]}
    d = Delivery(3, 2, [7, 8, 9], [[1, 2], [3, 4, 5, 6, 7], []], ["stop"] * 3, inputs.completions, [[0.0]] * 3,
                 scores={"reward": made})
    part = d.part(slice(1, 3))
    assert (part.seeds, part.completion_ids, part.texts, part.iteration, part.version) == (
        [8, 9], [[3, 4, 5, 6, 7], []], ["a b c d", ""], 3, 2)
    assert part.scores == {"reward": {"length": [4.0, 0.0], one: [1.0, 1.0]}}
    assert part.items is None and Delivery(0, 0, [7, 8, 9], [], [], [], None, items=["t7", "t8", "t9"]).part(
        slice(0, 1)).items == ["t7"]  # an algorithm's items (grpo_agent's trajectories) are cut the same way
    got = signal.score(None, inputs, None, functions=made)  # type: ignore[arg-type]  # no model: not read
    assert got["total"] == pytest.approx([1.0 + 2.0 - 0.02, 2.0 + 2.0 - 0.05, 0.0 + 2.0])
    assert got == signal.score(None, inputs, None)  # type: ignore[arg-type]  # as if scored here
    with pytest.raises(RuntimeError, match="expected the functions"):
        signal.score(None, inputs, None, functions={"length": [0.0] * 3})  # type: ignore[arg-type]


def constant_one(prompts: list, completions: list[str], **_: object) -> list[float]:
    """A reward function of 1 (the test above names it ``module:function``)."""
    return [1.0] * len(completions)


def test_reward_models_score_on_the_generators() -> None:
    """Under ``placement: separate`` the ``reward`` role of ``reward.model`` scores on the generators: the trainers'
    workload drops it (not with an evaluation set: their greedy evaluation scores with it), a sharded one is
    refused in one line, and a trainer takes a received ``model`` part instead of scoring (no models are passed:
    reading one would fail)."""
    from alignkit.algorithms import ALGORITHMS, workload_of
    from alignkit.rewards.signals import ScoreInputs, Signal
    from alignkit.train.generator_loop import generator_scored_roles, separate_workload

    base = ["algorithm=grpo", "model.name_or_path=x", "data.train=x.jsonl", "training.per_device_batch_size=8",
            "rollout.placement=separate"]

    def algo(*extra: str):
        cfg = load_config(None, [*base, *extra])
        return ALGORITHMS.get("grpo")(cfg, None), workload_of(cfg)

    plain, plain_work = algo()
    assert generator_scored_roles(plain) == [] and separate_workload(plain, plain_work, False) is plain_work
    rm, work = algo("reward.model=rm")
    assert generator_scored_roles(rm) == ["reward"] and "reward" in [s.role for s in work.specs]
    assert "reward" not in [s.role for s in separate_workload(rm, work, False).specs]
    evaluating, work = algo("reward.model=rm", "data.eval=[e.jsonl]")
    assert "reward" in [s.role for s in separate_workload(evaluating, work, False).specs]
    with pytest.raises(ConfigError, match="shard_frozen"):
        generator_scored_roles(algo("reward.model=rm", "distributed.shard_frozen=true")[0])
    signal = Signal("reward", [type("F", (), {"name": "length", "weight": 0.5})], model_role="reward", model_weight=2.0)
    inputs = ScoreInputs(["p"] * 2, ["a b", "a"], [2, 1], [{}] * 2, [])
    got = signal.score(None, inputs, None, functions={"length": [2.0, 1.0], "model": [0.25, -1.0]})  # type: ignore[arg-type]
    assert got["total"] == pytest.approx([0.5 * 2.0 + 2.0 * 0.25, 0.5 * 1.0 - 2.0])
    with pytest.raises(RuntimeError, match="expected the functions"):
        signal.score(None, inputs, None, functions={"length": [2.0, 1.0], "model": [0.0], "x": [0.0]})  # type: ignore[arg-type]
