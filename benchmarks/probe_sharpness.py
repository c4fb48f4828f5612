"""How sharp a policy is along its exact reward gradient (``learn_addition.py``'s reason to freeze the input side).

For 64 training sums of ``learn_addition.py``, the mean exact probability of the right answer (teacher forced:
``policy_eval.expected_accuracy``'s quantity) and its exact gradient; then that mean after a step along the gradient
of each norm in ``STEPS``, once over every parameter and once with the parameters ``learn_addition.FREEZE`` names
left out. A policy whose mean falls at small step norms cannot be improved by an optimizer whose steps are larger
(Adam's per-step norm is about lr x sqrt(parameters)). Usage::

    python benchmarks/probe_sharpness.py [POLICY_DIR]   # default: the cached learn_addition start
"""

from __future__ import annotations

import copy
import random
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
STEPS = [0.003, 0.01, 0.03, 0.1, 0.3]


def mean_right(model: torch.nn.Module, tok, rows: list[tuple[str, str]]) -> torch.Tensor:
    total = torch.zeros(())
    for q, a in rows:
        prompt = tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)["input_ids"]
        answer = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        logp = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        total = total + logp.gather(-1, torch.tensor(answer)[:, None]).sum().exp()
    return total / len(rows)


def main() -> None:
    import learn_addition as la
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = sys.argv[1] if len(sys.argv) > 1 else str(HERE / "results" / "models" / f"learn-add-{la.SFT_STEPS}" / "sft"
                                                     / "final")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    rng, train = random.Random(1), la.addition_pairs()[1]
    rows = [(r["prompt"], r["answer"]) for r in (la.row(*rng.choice(train)) for _ in range(64))]
    value = mean_right(model, tok, rows)
    value.backward()
    print(f"{path}: mean P(right) {value.item():.4f} on 64 training sums")
    names = [n for n, _ in model.named_parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    for label, keep in (("every parameter", lambda n: True),
                        (f"without {la.FREEZE}", lambda n: not any(re.search(x, n) for x in la.FREEZE))):
        g = [gr if keep(n) else torch.zeros_like(gr) for n, gr in zip(names, grads)]
        norm = torch.sqrt(sum((x ** 2).sum() for x in g))
        after = []
        for step in STEPS:
            moved = copy.deepcopy(model)
            with torch.no_grad():
                for p, x in zip(moved.parameters(), g):
                    p.add_(x, alpha=step / norm.item())
                after.append(mean_right(moved, tok, rows).item())
        print(f"  {label}: gradient norm {norm.item():.3f}; after a step of norm "
              + ", ".join(f"{s:g}: {v:.4f}" for s, v in zip(STEPS, after)))


if __name__ == "__main__":
    main()
