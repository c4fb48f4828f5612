"""One evaluator for the policies both sides of ``learn_grpo_vs_trl.py`` train: the same code, prompts, sampling
settings and random draws score alignkit's and TRL's final models and the shared starting policy.

Why: the training curve's "rise" (the last 10 iterations' mean reward minus the first 10) mixes three things: what
the policy learned, which prompts the two windows happened to hold (a window is 80 draws of the 100 products: easy
ones early make a seed look weak), and the updates already inside the first window (a side that learns faster in
its first 9 updates shows a higher start and so a smaller rise). Scoring each final policy on every product, many
samples each, with the same random numbers for every policy (common random numbers: the difference between two
policies is measured with much less noise than either alone), measures what was learned.

Sampling: plain ``transformers`` ``generate`` (no trainer's code), temperature 1.0, ``top_k=0``, ``top_p=1.0`` (the
full distribution, as both trainers sample in training), ``max_new_tokens`` as in training; the prompt is the
chat template's user turn with the generation prompt (the token ids both trainers use: ``--probe`` checked them
equal); the reward is ``bench_rewards.exact_answer``.
"""

from __future__ import annotations

import math
from typing import Any


def products() -> list[tuple[str, str]]:
    """Every single-digit product once: ("What is 7*8?", "56")."""
    return [(f"What is {x}*{y}?", str(x * y)) for x in range(10) for y in range(10)]


def evaluate(path: str, *, samples: int, max_new: int, seed: int, rows: list[tuple[str, str]] | None = None,
             greedy: bool = False) -> dict[str, Any]:
    """The mean exact-match reward of ``samples`` sampled completions per product of the policy at ``path``,
    with its standard error (over products: sampling noise and which products it knows), the reward per product,
    and the share of completions in the bare-number form (the form the reward asks for, right or wrong).
    ``rows``: other (question, answer) pairs than the 100 products (``learn_addition.py``'s held-out sums);
    ``greedy``: one greedy completion per row instead of ``samples`` sampled ones."""
    import bench_rewards
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = rows or products()
    samples = 1 if greedy else samples
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for q, _ in rows]
    groups: dict[int, list[int]] = {}  # prompts of one length generate together, without padding
    for i, x in enumerate(ids):
        groups.setdefault(len(x), []).append(i)
    per_product, bare = [0.0] * len(rows), 0
    for g, (length, members) in enumerate(sorted(groups.items())):
        batch = torch.tensor([ids[i] for i in members])
        torch.manual_seed(seed * 1000 + g)  # the same draws for every policy: common random numbers
        with torch.no_grad():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **sampling, max_new_tokens=max_new,
                                 num_return_sequences=samples,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        texts = tok.batch_decode(out[:, length:], skip_special_tokens=True)
        for j, i in enumerate(members):  # num_return_sequences repeats each prompt in place
            mine = texts[j * samples:(j + 1) * samples]
            per_product[i] = sum(bench_rewards.exact_answer([rows[i][0]] * samples, mine,
                                                            answer=[rows[i][1]] * samples)) / samples
            bare += sum(t.strip().isdigit() for t in mine)
    n = len(per_product)
    mean = sum(per_product) / n
    se = math.sqrt(sum((p - mean) ** 2 for p in per_product) / (n - 1) / n)
    return {"reward": mean, "se": se, "per_product": per_product, "bare_form": bare / (n * samples)}



def expected_accuracy(path: str, rows: list[tuple[str, str]]) -> float:
    """The exact probability of a right completion at temperature 1, averaged over ``rows``
    (:func:`right_probability` of the policy at ``path``): what the sampled accuracy estimates, without its
    sampling noise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return right_probability(model, tok, rows).item()


def right_probability(model: Any, tok: Any, rows: list[tuple[str, str]]) -> Any:
    """The mean over ``rows`` of the product of the policy's probabilities of the answer's tokens and of the
    end-of-turn token after them (teacher forcing; rows of one prompt and answer length in one forward), as a
    0-d tensor that carries gradients where the caller allows them (``probe_sharpness.py``). The answer is
    assumed to have one tokenization: digits are single tokens in the tiny tokenizer."""
    import torch

    groups: dict[tuple[int, int], list[list[int]]] = {}
    for q, a in rows:
        prompt = tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)["input_ids"]
        answer = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        groups.setdefault((len(prompt), len(answer)), []).append(prompt + answer)
    total = torch.zeros(())
    for (lp, _), seqs in groups.items():
        x = torch.tensor(seqs)
        logp = model(x).logits[:, lp - 1:-1].float().log_softmax(-1)
        total = total + logp.gather(-1, x[:, lp:, None])[..., 0].sum(-1).exp().sum()
    return total / len(rows)
