"""How sharp a policy is along its exact reward gradient (``learn_addition.py``'s reason to freeze the input side).

For 64 training sums of ``learn_addition.py``, the mean exact probability of the right answer (teacher forced:
``policy_eval.right_probability``) and its exact gradient; then that mean after a step along the gradient
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


def main() -> None:
    import learn_addition as la
    from policy_eval import right_probability
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = sys.argv[1] if len(sys.argv) > 1 else str(HERE / "results" / "models" / f"learn-add-{la.SFT_STEPS}" / "sft"
                                                     / "final")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    rng, train = random.Random(1), la.addition_pairs()[1]
    rows = [(r["prompt"], r["answer"]) for r in (la.row(*rng.choice(train)) for _ in range(64))]
    value = right_probability(model, tok, rows)
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
                after.append(right_probability(moved, tok, rows).item())
        print(f"  {label}: gradient norm {norm.item():.3f}; after a step of norm "
              + ", ".join(f"{s:g}: {v:.4f}" for s, v in zip(STEPS, after)))


if __name__ == "__main__":
    main()
