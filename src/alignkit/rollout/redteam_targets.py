"""Red-team targets by name: what answers the attacker's attacks (frozen, under no_grad).

* ``lm``: a causal LM (the ``target`` role, loaded on every rank like any frozen role, with its OWN tokenizer:
  ``models.roles.role_tokenizer``; generation goes through the run's engine class built on that tokenizer,
  ``RolloutContext.engine_for``) continues ``template`` with the attack in place of ``{prompt}`` (default the
  Flow-RTPO guide's "Please extend the following sentence: {prompt}"), rendered with the target's chat
  template when it has one and ``chat_template`` is on; greedy by default.
* ``module:function``: anything else (an API client, a scripted model): ``fn(attacks, seed_prompt=[...],
  **row_fields) -> list[str]``, one answer per attack, called on every rank for its own attacks.
* ``t2i_vlm``: the Flow-RTPO chain. A renderer (``models/diffusion_render.py``: a diffusers pipeline by
  name/path, or ``builtin:shapes``) draws each attack, then a frozen LLaVA-family VLM (the ``target`` role,
  kind ``vlm``, with its own processor) continues ``template`` on that image (one image placeholder before
  the templated attack, through the VLM's chat template: :func:`vlm_text`); its text is the output the
  scorers read. Generation is the one VLM path (``rollout.vlm_generate.image_prompt`` requests through the
  role's engine). Its :meth:`draw` renders the attacks first, and the red-team rollout hands those images to
  ``respond`` and to the scorers that read them (``clip_quality``); a text target draws nothing (None). Nothing
  of one rollout stays on a target.

A multi-turn red team (``redteam.turns`` > 1, ``rollout/redteam_conversation.py``) asks ``converse`` instead: the
attack after the conversation's earlier (attack, answer) turns. ``lm``: the whole conversation through the target's
chat template (:func:`conversation_text`); ``module:function``: ``conversation=`` the earlier turns as messages.
``t2i_vlm`` answers single attacks only.
"""

from __future__ import annotations

from typing import Any

import torch

from alignkit.data.prompts import prompt_text
from alignkit.errors import ConfigError
from alignkit.models.diffusion_render import build_renderer
from alignkit.models.roles import ModelSpec
from alignkit.models.sources import model_errors
from alignkit.registry import Registry
from alignkit.rewards.functions import RewardFunctionError, by_field, resolve
from alignkit.rollout.engine import SamplingParams
from alignkit.rollout.vlm_generate import image_prompt

TARGETS: Registry[type] = Registry("red-team target")


def fill(template: str, attack: str) -> str:
    """``template`` with ``{prompt}`` replaced by the attack (other braces are left as written)."""
    return template.replace("{prompt}", attack)


@TARGETS.register("lm")
class LMTarget:
    """A frozen causal LM continuing the templated attack (module docstring)."""

    def __init__(self, cfg: Any) -> None:
        if not cfg.model:
            raise ConfigError("redteam.target.model: the lm target needs a model (hub id or local directory)")
        if "{prompt}" not in cfg.template:
            raise ConfigError("redteam.target.template must hold {prompt} (where the attack goes)")
        self.cfg = cfg

    def specs(self) -> list[ModelSpec]:
        return [ModelSpec("target", self.cfg.model, "lm", tokenizer=self.cfg.tokenizer or self.cfg.model)]

    def draw(self, ctx: Any, attacks: list[str]) -> list[Any] | None:
        """The images ``respond`` answers on: none for a text target."""
        return None

    @torch.no_grad()
    def respond(self, ctx: Any, attacks: list[str], seeds: list[Any], fields: list[dict[str, Any]]) -> list[str]:
        return self.converse(ctx, [[] for _ in attacks], attacks, seeds, fields)

    @torch.no_grad()
    def converse(self, ctx: Any, history: list[list[tuple[str, str]]], attacks: list[str], seeds: list[Any],
                 fields: list[dict[str, Any]]) -> list[str]:
        """The answer to each attack after its conversation's earlier ``(attack, answer)`` turns (``history``;
        empty: :meth:`respond`), every conversation in one generation call: :func:`conversation_text`."""
        tok = ctx.models.tokenizer("target")
        texts = [conversation_text(tok, self.cfg.template, h, a, self.cfg.chat_template) for h, a in zip(history, attacks)]
        ids = [tok(t, add_special_tokens=False)["input_ids"][-self.cfg.max_prompt_tokens :] for t in texts]
        params = SamplingParams(self.cfg.max_new_tokens, self.cfg.temperature, batch_size=ctx.params.batch_size)
        return ctx.generate("target", ids, params).texts


@TARGETS.register("t2i_vlm")
class T2IVLMTarget(LMTarget):
    """A renderer then a frozen VLM continuing the templated attack on the image (module docstring)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.renderer, self.processor = build_renderer(cfg), None

    def specs(self) -> list[ModelSpec]:
        return [ModelSpec("target", self.cfg.model, "vlm", tokenizer=self.cfg.tokenizer or self.cfg.model)]

    @torch.no_grad()
    def respond(self, ctx: Any, attacks: list[str], seeds: list[Any], fields: list[dict[str, Any]],
                images: list[Any] | None = None) -> list[str]:
        """The VLM's continuation of each attack on its image: ``images`` (:meth:`draw`'s, or flow_rtpo's trained
        image policy's), else the renderer's drawn here."""
        if self.processor is None:
            from transformers import AutoProcessor

            with model_errors(self.cfg.model):
                self.processor = AutoProcessor.from_pretrained(self.cfg.tokenizer or self.cfg.model)
        images = list(images) if images is not None else self.draw(ctx, attacks)
        texts = [vlm_text(self.processor, fill(self.cfg.template, a), self.cfg.chat_template) for a in attacks]
        requests = [image_prompt(self.processor, t, [img]) for t, img in zip(texts, images)]
        params = SamplingParams(self.cfg.max_new_tokens, self.cfg.temperature, batch_size=ctx.params.batch_size)
        return ctx.generate("target", requests, params).texts

    @torch.no_grad()
    def draw(self, ctx: Any, attacks: list[str]) -> list[Any]:
        """Each attack rendered by the renderer, on the rank's device."""
        return self.renderer(attacks, ctx.strategy.device)


def vlm_text(processor: Any, text: str, chat_template: bool) -> str:
    """``text`` after one image, as a VLM reads it: through the processor's chat template (typed content, as
    llava-hf models ship it), else the tokenizer's, else plain (``<image>`` and a newline before the text)."""
    if chat_template and getattr(processor, "chat_template", None):
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        return processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    plain = f"{getattr(processor, 'image_token', '<image>')}\n{text}"
    return prompt_text(processor.tokenizer, plain) if chat_template else plain


def conversation_text(tok: Any, template: str, history: list[tuple[str, str]], attack: str, chat_template: bool) -> str:
    """What an ``lm`` target reads: every attack of the conversation templated as a user message, its own earlier
    answers as assistant messages, rendered by its chat template with the assistant turn opened (when it has one
    and ``chat_template`` is on), else the messages' texts one a line. Without ``history``: the templated attack
    through :func:`prompt_text`, as the single-turn red team always rendered it."""
    if not history:
        return prompt_text(tok, fill(template, attack)) if chat_template else fill(template, attack)
    msgs = [m for a, r in history for m in ({"role": "user", "content": fill(template, a)},
                                            {"role": "assistant", "content": r})]
    msgs.append({"role": "user", "content": fill(template, attack)})
    if chat_template and getattr(tok, "chat_template", None):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in msgs)


class FunctionTarget:
    """A user's ``module:function`` answering each attack (module docstring)."""

    def __init__(self, cfg: Any) -> None:
        self.name, self.fn = cfg.name, resolve(cfg.name)

    def specs(self) -> list[ModelSpec]:
        return []

    def draw(self, ctx: Any, attacks: list[str]) -> None:
        return None

    def respond(self, ctx: Any, attacks: list[str], seeds: list[Any], fields: list[dict[str, Any]]) -> list[str]:
        return self.call(attacks, seeds, fields, {})

    def converse(self, ctx: Any, history: list[list[tuple[str, str]]], attacks: list[str], seeds: list[Any],
                 fields: list[dict[str, Any]]) -> list[str]:
        """``fn(attacks, seed_prompt=[...], conversation=[...], **row_fields)``: ``conversation`` holds, per attack,
        the earlier turns as messages (the attacks as ``user``, the function's answers as ``assistant``)."""
        turns = [[m for a, r in h for m in ({"role": "user", "content": a}, {"role": "assistant", "content": r})]
                 for h in history]
        return self.call(attacks, seeds, fields, {"conversation": turns})

    def call(self, attacks: list[str], seeds: list[Any], fields: list[dict[str, Any]], extra: dict[str, Any]) -> list[str]:
        try:
            out = list(self.fn(attacks, seed_prompt=seeds, **extra, **by_field(fields)))
        except Exception as e:  # a user's function: one line naming it
            raise RewardFunctionError(f"red-team target {self.name!r} raised {type(e).__name__}: {e}") from e
        if len(out) != len(attacks) or not all(isinstance(o, str) for o in out):
            raise RewardFunctionError(f"red-team target {self.name!r} must return {len(attacks)} strings, one per attack")
        return out


def build_target(cfg: Any) -> Any:
    """The target of the ``redteam.target`` section: a registered name or ``module:function``."""
    if ":" in cfg.name:
        return FunctionTarget(cfg)
    return TARGETS.get(cfg.name)(cfg)
