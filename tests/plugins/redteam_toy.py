"""A toy red-team algorithm registered from OUTSIDE the package (the worked example of docs/architecture.md
"add an online algorithm"): the policy writes an attack on each prompt, a frozen ``target`` role answers
the attack, and the reward judges the TARGET's answer, not the policy's text. Only ``rollout`` and the
model list differ from GRPO; the loop, the scorers and the update are alignkit's.

Use: ``plugins: [tests.plugins.redteam_toy]`` and ``algorithm: toy_redteam`` (GRPO's ``grpo:`` keys apply).
"""

from __future__ import annotations

from typing import Any

from alignkit.algorithms.grpo import GRPO
from alignkit.config.schema import RunConfig
from alignkit.config.sections import register_algorithm
from alignkit.data.prompts import prompt_text
from alignkit.models.roles import ModelSpec
from alignkit.rollout.config import RolloutConfig
from alignkit.rollout.context import Experience, RolloutContext, rollout_stats
from alignkit.rollout.engine import SamplingParams


@register_algorithm("toy_redteam")
class ToyRedTeam(GRPO):
    name = "toy_redteam"

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        target = cfg.model.ref_name_or_path or cfg.model.name_or_path  # the model under attack, frozen
        return [*super().model_specs(cfg), ModelSpec("target", target, "lm")]

    def rollout(self, ctx: RolloutContext) -> Experience:
        attacks = ctx.generate("policy", [row["prompt_ids"] for row in ctx.rows])
        tok = self.tokenizer  # the target shares the policy's tokenizer in this toy
        asks = [tok(prompt_text(tok, a), add_special_tokens=False)["input_ids"] for a in attacks.texts]
        greedy = SamplingParams(self.cfg.section(RolloutConfig).max_new_tokens, 0.0)
        answers = ctx.generate("target", asks, greedy)
        samples = ctx.samples(attacks.completion_ids)  # the policy is trained on its own attacks
        inputs = ctx.score_inputs(samples, answers.texts)  # ... rewarded by what the target said
        scores = ctx.score(self.signals(), inputs)
        stats = self.make_experience(ctx, samples, inputs.batches, scores)
        for s, row, attack, answer in zip(samples, ctx.rows, attacks.texts, answers.texts):
            s["prompt"], s["completion"], s["log"] = row["prompt"], attack, {"target": answer}
        rollout_stats(stats, scores, attacks, ctx.generate_s)
        return Experience(samples, scores, stats)


def answer_words(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """A stand-in judge: the number of words in the target's answer, over 10."""
    return [len(c.split()) / 10 for c in completions]
