"""Per-completion sampling streams (rollout/seeds.py): a completion's draws come from its own seed, so the same
seed samples the same completion in any batch, beside any other rows, on any process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignkit.rollout.engine import HFEngine, InverseCDFSampler, Prompt, SamplingParams, row_seeds
from alignkit.rollout.seeds import completion_seeds, eval_seeds, sample_seed, with_stream


def test_seeds_are_a_function_of_the_tuple() -> None:
    a = sample_seed(42, 3, 17, 1)
    assert a == sample_seed(42, 3, 17, 1) and 0 <= a < 2**63
    others = {sample_seed(42, 4, 17, 1), sample_seed(42, 3, 18, 1), sample_seed(42, 3, 17, 2),
              sample_seed(43, 3, 17, 1), sample_seed(42, 3, 17, 1, "target")}
    assert a not in others and len(others) == 5
    # a group's completions: the prompt's index with each generation index 0..G-1
    assert completion_seeds(42, 3, [17, 17, 5, 5], 2) == [sample_seed(42, 3, 17, 0), sample_seed(42, 3, 17, 1),
                                                          sample_seed(42, 3, 5, 0), sample_seed(42, 3, 5, 1)]
    assert with_stream([a], "policy") == [a] and with_stream([a], "target") != [a]


def test_eval_seeds_are_their_own_stream() -> None:
    """``rollout.eval_samples``: n per eval prompt, in order, on the "eval" stream (never a training completion's seed:
    that of iteration 0, the same prompt index and generation, is another), the same for any share of the prompts."""
    assert eval_seeds(7, [4, 1], 2) == [sample_seed(7, 0, 4, 0, "eval"), sample_seed(7, 0, 4, 1, "eval"),
                                        sample_seed(7, 0, 1, 0, "eval"), sample_seed(7, 0, 1, 1, "eval")]
    assert not set(eval_seeds(7, [0, 1, 2], 4)) & set(completion_seeds(7, 0, [0, 0, 0, 0, 1, 1, 1, 1], 4))
    assert eval_seeds(7, [0, 2], 3) + eval_seeds(7, [1], 3) != eval_seeds(7, [0, 1, 2], 3)  # per prompt, not position
    assert sorted(eval_seeds(7, [0, 2], 3) + eval_seeds(7, [1], 3)) == sorted(eval_seeds(7, [0, 1, 2], 3))


def test_a_row_draws_from_its_own_generator_whatever_shares_its_batch() -> None:
    logits = torch.randn(3, 50)
    seeds = [11, 22, 33]
    together = InverseCDFSampler(1.0, seeds=seeds)
    alone = InverseCDFSampler(1.0, seeds=[22])
    torch.manual_seed(0)  # the global generator plays no part
    for _ in range(5):
        out = together(torch.zeros(3, 1, dtype=torch.long), logits.clone()).argmax(-1)
        torch.manual_seed(1)
        one = alone(torch.zeros(1, 1, dtype=torch.long), logits[1:2].clone()).argmax(-1)
        assert out[1] == one[0]
    with pytest.raises(ValueError, match="2 seeds for 3 rows"):
        InverseCDFSampler(1.0, seeds=[1, 2])(torch.zeros(3, 1, dtype=torch.long), logits.clone())


def test_a_batch_is_all_seeded_or_not() -> None:
    assert row_seeds([Prompt([1]), Prompt([2])]) is None
    assert row_seeds([Prompt([1], seed=5), Prompt([2], seed=6)]) == [5, 6]
    with pytest.raises(ValueError, match="every prompt"):
        row_seeds([Prompt([1], seed=5), Prompt([2])])


def test_hf_engine_samples_the_same_completions_in_any_batching(micro_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(micro_model)).eval()
    engine = HFEngine(AutoTokenizer.from_pretrained(str(micro_model)))
    rows = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10]]  # padded to 4 in a batch with the others, not alone
    prompts = [Prompt(r, seed=s) for r, s in zip(rows, completion_seeds(0, 0, [0, 0, 1, 1], 2))]
    torch.manual_seed(0)
    whole = engine.generate(model, prompts, SamplingParams(8, 1.0, batch_size=4)).completion_ids
    torch.manual_seed(1)
    single = engine.generate(model, prompts, SamplingParams(8, 1.0, batch_size=1)).completion_ids
    backwards = engine.generate(model, prompts[::-1], SamplingParams(8, 1.0, batch_size=2)).completion_ids
    assert whole == single == backwards[::-1]
    assert whole[0] != whole[1]  # a group's completions: different streams
    unseeded = [engine.generate(model, rows, SamplingParams(8, 1.0, batch_size=4)).completion_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # without seeds: the global generator, as before


@pytest.mark.parametrize("top_k", [0, 5])
def test_hf_engine_reports_the_drawn_tokens_log_probs_of_a_training_forward(micro_model: Path, top_k: int) -> None:
    """``SamplingParams.logprobs``: the sampler's log-prob of each drawn token, taken off the decoding step's logits
    (a separate placement's stale samples: no extra forward) = log softmax(logits / T) of a full forward of prompt +
    completion at that token, top-k not applied (the trainer's log-probs; without top-k: the sampling softmax's
    own, with it: from the raw logits); the same draws as without; greedy and unasked: none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(micro_model)).eval()
    engine = HFEngine(AutoTokenizer.from_pretrained(str(micro_model)))
    rows = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    prompts = [Prompt(r, seed=s) for r, s in zip(rows, completion_seeds(0, 0, [0, 1, 2], 1))]
    params = SamplingParams(10, 0.7, top_k=top_k, batch_size=2)
    gens = engine.generate(model, prompts, SamplingParams(10, 0.7, top_k=top_k, batch_size=2, logprobs=True))
    assert gens.completion_ids == engine.generate(model, prompts, params).completion_ids
    assert engine.generate(model, prompts, params).logps is None
    assert engine.generate(model, prompts, SamplingParams(10, 0.0, logprobs=True)).logps is None
    assert gens.logps is not None
    for row, ids, lps in zip(rows, gens.completion_ids, gens.logps):
        assert len(lps) == len(ids) > 0
        with torch.no_grad():
            logits = model(torch.tensor([row + ids])).logits[0, len(row) - 1 : -1].float() / 0.7
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lps), want, atol=1e-5), (lps, want)


def test_a_generation_configs_own_processors_do_not_bend_the_rollout(micro_model: Path) -> None:
    """A model's ``generation_config.json`` may turn on logits processors (Qwen2.5's ``repetition_penalty: 1.05``):
    the rollout engine switches them off, so a sample is drawn from the policy the trainer scores (its recorded
    log-probs = the forward's) and greedy is the forward's argmax. With a strong repetition penalty and
    no-repeat bigrams asked for, the outputs equal those of the model without them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = AutoModelForCausalLM.from_pretrained(str(micro_model)).eval()
    bent = AutoModelForCausalLM.from_pretrained(str(micro_model)).eval()
    bent.generation_config.repetition_penalty, bent.generation_config.no_repeat_ngram_size = 5.0, 1
    bent.generation_config.min_new_tokens = 12  # EOS forbidden for 12 steps
    engine = HFEngine(AutoTokenizer.from_pretrained(str(micro_model)))
    prompts = [Prompt([5, 6, 7, 8], seed=s) for s in completion_seeds(0, 0, [0, 1], 1)]
    for params in (SamplingParams(12, 0.0), SamplingParams(12, 1.0, logprobs=True)):
        want, got = engine.generate(plain, prompts, params), engine.generate(bent, prompts, params)
        assert got.completion_ids == want.completion_ids and got.logps == want.logps
    greedy = engine.generate(plain, prompts, SamplingParams(12, 0.0)).completion_ids[0]
    assert len(set(greedy)) < len(greedy)  # the micro model repeats a token greedily: the penalty would have bitten
