"""The one scorer registry (``SCORERS``): what reads a sample (the policy's text, a target's output, a rendered
image) and says how toxic (or how good) it is. A :class:`Scorer` is one entry of ``redteam.scorers`` /
``flow_grpo.scorers``; a :class:`ScorerSet` is a section's entries by score name, placed and weighted into the
reward's terms. (A whole online signal, reward functions + a reward model + a length penalty, is a
``rewards.signals.Signal``.)

Each scorer gets a :class:`Judged` batch (attacks, the target's outputs, the seed prompts, the rows' fields)
and returns one float per sample (None / NaN = cannot score). Models are loaded LAZILY, on the ranks that
score: with ``redteam.placement: main`` a big classifier lives on rank 0 alone. Entries:

* ``toxicity``: a transformers text-classification model by name or path; a multi-label model (Detoxify
  style, ``problem_type: multi_label_classification``) gives the mean of its heads' sigmoids (``heads``:
  which labels; default all), a single-label one the softmax probability of its toxic label (the label whose
  name contains "tox", else the last; or ``heads: [name]``);
* ``detoxify``: the ``detoxify`` package when installed (``model``: original | unbiased | multilingual): the
  mean of its heads, as the Flow-RTPO guide does;
* ``fluency``: a quality from a small causal LM (``model``), the geometric-mean probability of the text's
  tokens (use ``text: attack``);
* ``seed_similarity``: a quality for ``mode: rewrite``, the word n-gram Jaccard similarity of the attack to
  its seed prompt;
* ``reward_model`` / ``cost_model``: a scalar model alignkit trained (its final dir), scoring (attack,
  output) as training encoded pairs; ``activation: sigmoid`` maps a cost (C > 0 unsafe) into (0, 1);
* ``clip_quality``: a quality for the ``t2i_vlm`` target, the image-text similarity of a transformers CLIP
  (``model``: ``CLIPModel`` + ``CLIPProcessor``) between the rendered image and the attack, ``logits_per_image
  / 30`` as the Flow-RTPO guide (about 3.33 cos with CLIP's logit scale 100);
* ``shapes_colour``: a programmatic reward of the image rendered from the attack (a flow policy's image, or the
  ``t2i_vlm`` target's) for the shipped shapes task: the asked colour at the named cell
  (:mod:`alignkit.rewards.image`); NaN for a prompt that names no ``<colour> <shape> in the <position>``;
* ``shapes_hit``: the same images' yes/no reading, the share of the named objects whose cell shows the asked colour;
* anything else: a reward function of ``rewards/functions.py`` (``unsafe``: the toy world's program judge) or
  ``module:function``, called as ``fn(attacks, outputs, seed_prompt=[...], **row_fields)``; where the samples
  are images (a flow policy's: ``attacks`` = their prompts, ``outputs`` = empty strings; the ``t2i_vlm`` target's
  rendered attacks) also with ``images=[...]``, one RGB ``PIL.Image.Image`` per sample (``np.asarray(im)``:
  ``(H, W, 3)`` uint8; ``torchvision``'s ``to_tensor``: ``(3, H, W)`` floats in [0, 1]).

Each scorer declares what it reads: ``reads_image`` (the rendered image: ``clip_quality``, ``shapes_*``) and
``reads_output`` (the target's answer: the model scorers with ``text: output``, the reward functions), so that
flow_rtpo's image policy is rewarded only by what its image can change (:func:`depends_on_image`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from alignkit.errors import ConfigError, ModelError
from alignkit.models.scalar import load_scorer
from alignkit.models.sources import model_errors
from alignkit.registry import Registry
from alignkit.rewards import image as image_rewards
from alignkit.rewards.cvar import jaccard, ngrams
from alignkit.rewards.functions import REWARD_FUNCTIONS, WeightedFunction, by_field, call, combine, resolve
from alignkit.rewards.scalar import score_responses, trained_format
from alignkit.rewards.signals import on_main


@dataclass
class Judged:
    """Samples to score: ``attacks`` (the policy's text), ``outputs`` (the target's answer), ``seeds`` (the rows'
    prompts as written: the instruction or the seed prompt), each row's other ``fields`` and ``images``."""

    attacks: list[str]
    outputs: list[str]
    seeds: list[Any]
    fields: list[dict[str, Any]]
    #: the image each attack was rendered to (the ``t2i_vlm`` target; None per sample otherwise)
    images: list[Any] = dataclasses.field(default_factory=list)

    def texts(self, which: str) -> list[str]:
        return self.outputs if which == "output" else self.attacks

    @staticmethod
    def join(parts: list["Judged"]) -> "Judged":
        return Judged(*(sum((getattr(p, f.name) for p in parts), []) for f in dataclasses.fields(Judged)))


SCORERS: Registry[type] = Registry("scorer")


class Scorer:
    """One scorer: built from its config entry (and the run's ``model:`` section, for ``trust_remote_code``), called
    on a :class:`Judged` batch with the scoring rank's device; one value per sample (None = cannot score)."""

    #: whether its value reads the rendered image / the target's answer (:func:`depends_on_image`)
    reads_image: bool = False
    reads_output: bool = False

    def __init__(self, cfg: Any, model_cfg: Any) -> None:
        self.cfg = cfg

    def __call__(self, batch: Judged, device: torch.device) -> list[float | None]:
        raise NotImplementedError


class ModelScorer(Scorer):
    """A scorer holding a model it loads on first use (on the scoring rank's ``device``)."""

    @property  # type: ignore[override]
    def reads_output(self) -> bool:
        return self.cfg.text == "output"

    def __init__(self, cfg: Any, model_cfg: Any) -> None:
        if not cfg.model:
            raise ConfigError(f"redteam.scorers: {cfg.name} needs a model (a name or path)")
        super().__init__(cfg, model_cfg)
        self.model_cfg, self.model, self.tokenizer = model_cfg, None, None

    def load(self, device: torch.device) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, batch: Judged, device: torch.device) -> list[float | None]:
        if self.model is None:
            self.load(device)
        texts, out = batch.texts(self.cfg.text), []
        for start in range(0, len(texts), self.cfg.batch_size):
            out += self.score(texts[start : start + self.cfg.batch_size], batch, start, device)
        return out

    def score(self, texts: list[str], batch: Judged, start: int, device: torch.device) -> list[float]:
        raise NotImplementedError


@SCORERS.register("toxicity")
class ToxicityScorer(ModelScorer):
    """A transformers sequence classifier (module docstring)."""

    def load(self, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        with model_errors(self.cfg.model):
            self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model, trust_remote_code=self.model_cfg.trust_remote_code)
            model = AutoModelForSequenceClassification.from_pretrained(
                self.cfg.model, trust_remote_code=self.model_cfg.trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.eval().to(device)
        self.heads = toxicity_heads(model.config, self.cfg.heads, self.cfg.activation)

    def score(self, texts: list[str], batch: Judged, start: int, device: torch.device) -> list[float]:
        enc = self.tokenizer([t or " " for t in texts], return_tensors="pt", padding=True, truncation=True,
                             max_length=self.cfg.max_length).to(device)
        logits = self.model(**enc).logits.float()
        activation, index = self.heads
        probs = logits.sigmoid() if activation == "sigmoid" else logits.softmax(-1)
        return probs[:, index].mean(-1).cpu().tolist()


def toxicity_heads(config: Any, heads: list[str], activation: str) -> tuple[str, list[int]]:
    """(sigmoid | softmax, the label indices averaged) of a classifier's ``config`` (module docstring)."""
    labels = {str(v): int(k) for k, v in (getattr(config, "id2label", None) or {}).items()}
    n = int(config.num_labels)
    if activation == "auto":
        multi = getattr(config, "problem_type", None) == "multi_label_classification" or n == 1
        activation = "sigmoid" if multi else "softmax"
    if heads:
        missing = [h for h in heads if h not in labels]
        if missing:
            raise ModelError(f"redteam.scorers: toxicity heads {missing} are not labels of the model ({sorted(labels)})")
        return activation, [labels[h] for h in heads]
    if activation == "sigmoid":
        return activation, list(range(n))
    toxic = [i for name, i in sorted(labels.items()) if "tox" in name.lower() and "non" not in name.lower()]
    return activation, toxic[:1] or [n - 1]


@SCORERS.register("detoxify")
class DetoxifyScorer(ModelScorer):
    """The ``detoxify`` package (``pip install detoxify``): the mean of its heads."""

    def load(self, device: torch.device) -> None:
        try:
            from detoxify import Detoxify
        except ImportError:
            raise ModelError("redteam.scorers: detoxify is not installed (pip install detoxify), or use "
                             "name: toxicity with a transformers classifier") from None
        self.model = Detoxify(self.cfg.model, device=str(device))

    def score(self, texts: list[str], batch: Judged, start: int, device: torch.device) -> list[float]:
        heads = self.model.predict(texts)
        rows = [[float(v) for v in (values if isinstance(values, list) else [values])] for values in heads.values()]
        return [sum(col) / len(col) for col in zip(*rows)]


@SCORERS.register("reward_model")
@SCORERS.register("cost_model")
class ScalarModelScorer(ModelScorer):
    """A reward or cost model alignkit trained, on (attack, output) pairs encoded as its training pairs."""

    def load(self, device: torch.device) -> None:
        self.model, self.tokenizer = load_scorer(self.cfg.model)  # full or LoRA adapter directory, with its tokenizer
        self.model.to(device)
        # encoded as its training run did (its config.yaml), as `alignkit score` does
        self.chat_template = bool(trained_format(self.cfg.model).get("chat_template", False))

    def score(self, texts: list[str], batch: Judged, start: int, device: torch.device) -> list[float]:
        prompts = batch.attacks[start : start + len(texts)]
        scores = score_responses(self.model, self.tokenizer, prompts, texts, chat_template=self.chat_template,
                                 max_length=self.cfg.max_length, device=device)
        return (scores.sigmoid() if self.cfg.activation == "sigmoid" else scores).cpu().tolist()


@SCORERS.register("clip_quality")
class ClipQualityScorer(ModelScorer):
    """CLIP similarity of each rendered image to its attack (module docstring)."""

    reads_image, reads_output = True, False  # type: ignore[assignment]

    def load(self, device: torch.device) -> None:
        from transformers import CLIPModel, CLIPProcessor

        with model_errors(self.cfg.model):
            self.tokenizer = CLIPProcessor.from_pretrained(self.cfg.model)
            model = CLIPModel.from_pretrained(self.cfg.model)
        self.model = model.eval().to(device)

    def score(self, texts: list[str], batch: Judged, start: int, device: torch.device) -> list[float]:
        images = batch.images[start : start + len(texts)]
        if len(images) != len(texts) or any(im is None for im in images):
            raise ConfigError("redteam.scorers: clip_quality needs rendered images (redteam.target.name: t2i_vlm)")
        attacks = batch.attacks[start : start + len(texts)]
        enc = self.tokenizer(text=[a or " " for a in attacks], images=list(images), return_tensors="pt", padding=True,
                             truncation=True, max_length=min(self.cfg.max_length, self.max_positions())).to(device)
        return (self.model(**enc).logits_per_image.float().diagonal() / 30).cpu().tolist()

    def max_positions(self) -> int:
        return int(self.model.config.text_config.max_position_embeddings)


@SCORERS.register("fluency")
class FluencyScorer(ModelScorer):
    """A quality from a small causal LM (``model``): exp of the mean log-probability of the text's tokens (the
    geometric-mean token probability, in (0, 1]; higher = more natural), usually with ``text: attack``;
    0 for an empty text."""

    def load(self, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with model_errors(self.cfg.model):
            self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model, trust_remote_code=self.model_cfg.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(self.cfg.model, trust_remote_code=self.model_cfg.trust_remote_code)
        self.model = model.eval().to(device)

    def score(self, texts: list[str], batch: Judged, start: int, device: torch.device) -> list[float]:
        out = []
        for text in texts:  # one row at a time: no padding to get wrong, and attacks are short
            ids = self.tokenizer(text, return_tensors="pt", truncation=True, max_length=self.cfg.max_length)["input_ids"]
            bos = self.tokenizer.bos_token_id
            if bos is not None and (ids.numel() == 0 or int(ids[0, 0]) != bos):
                ids = torch.cat([torch.tensor([[bos]]), ids], dim=1)  # the first word is scored too
            if ids.shape[1] < 2:
                out.append(0.0)
                continue
            logps = self.model(input_ids=ids.to(device)).logits[0, :-1].float().log_softmax(-1)
            token = logps.gather(1, ids[0, 1:].to(device).unsqueeze(1))
            out.append(float(token.mean().exp()))
        return out


@SCORERS.register("seed_similarity")
class SeedSimilarityScorer(Scorer):
    """A quality for ``mode: rewrite``: the Jaccard similarity of the attack's word 1..2-grams to its seed
    prompt's (1 = the same words; keeps a rewrite close to what it rewrites), model-free."""

    def __call__(self, batch: Judged, device: torch.device) -> list[float]:
        return [jaccard(ngrams(a, 2), ngrams(str(s), 2)) for a, s in zip(batch.attacks, batch.seeds)]


@SCORERS.register("shapes_colour")
class ShapesColourScorer(Scorer):
    """The shapes task's colour-at-position reward of each image for its text (module docstring), model-free."""

    function = "shapes_colour"  # of alignkit.rewards.image
    reads_image = True

    def __call__(self, batch: Judged, device: torch.device) -> list[float | None]:
        if len(batch.images) != len(batch.attacks) or any(im is None for im in batch.images):
            raise ConfigError(f"redteam.scorers: {self.function} scores rendered images (a flow policy's or the "
                              "t2i_vlm target's)")
        score = getattr(image_rewards, self.function)
        objects = [image_rewards.prompt_objects(a) for a in batch.attacks]
        return [score(im, objs) if objs else None for im, objs in zip(batch.images, objects)]


@SCORERS.register("shapes_hit")
class ShapesHitScorer(ShapesColourScorer):
    """The share of each image's named objects whose cell shows the asked colour (module docstring)."""

    function = "shapes_hit"


class FunctionScorer(Scorer):
    """A reward function by name or ``module:function`` on (attacks, outputs) with the rows' fields, and with
    ``images=`` (:func:`images_of`) where the batch holds images (a flow policy's, the ``t2i_vlm`` target's)."""

    reads_output = True  # it is handed the answers: whether it reads them is its own affair

    def __init__(self, cfg: Any, model_cfg: Any) -> None:
        super().__init__(cfg, model_cfg)
        self.fn = WeightedFunction(cfg.name, 1.0, resolve(cfg.name))

    def __call__(self, batch: Judged, device: torch.device) -> list[float]:
        fields = {**by_field(batch.fields), "seed_prompt": batch.seeds, **images_of(batch)}
        return call(self.fn, batch.attacks, batch.outputs, fields)


def images_of(batch: Judged) -> dict[str, list[Any]]:
    """``{"images": [...]}``: the batch's images, one per sample, as RGB PIL images (what the diffusion kind decodes
    and a renderer draws), when every sample has one; else {} (text samples: a function is called as before)."""
    if not batch.images or len(batch.images) != len(batch.attacks) or any(im is None for im in batch.images):
        return {}
    return {"images": [im.convert("RGB") if getattr(im, "mode", "RGB") != "RGB" else im for im in batch.images]}


def build_scorer(cfg: Any, model_cfg: Any) -> Scorer:
    """The scorer of one ``redteam.scorers`` entry."""
    if cfg.name in SCORERS:
        return SCORERS.get(cfg.name)(cfg, model_cfg)
    return FunctionScorer(cfg, model_cfg)


def check_scorer_name(name: str, key: str = "redteam.scorers") -> None:
    """A scorer, a reward function or ``module:function``; else the one-line error naming ``key`` and the choices."""
    if not name:
        raise ConfigError(f"{key}: each entry needs a name")
    if ":" in name or name in SCORERS or name in REWARD_FUNCTIONS:
        return
    choices = sorted([*SCORERS.names(), *REWARD_FUNCTIONS.names()])
    raise ConfigError(f"{key}: unknown scorer {name!r}; choose one of {choices} or 'module:function'")


def judge_placed(scorers: list[tuple[str, Any, Any]], batch: Judged, device: torch.device,
                 placement: str) -> dict[str, list[float]]:
    """Every scorer's values of this rank's samples (``key`` -> list, NaN = unscorable) for ``(key, config,
    scorer)`` entries: computed here (``local``) or on rank 0 over every rank's samples, each rank receiving
    its own (``main``: ``rewards.signals.on_main``)."""
    def compute(items: list[Judged]) -> dict[str, list[float]]:
        whole = Judged.join(items)
        return {key: [float("nan") if v is None else float(v) for v in scorer(whole, device)]
                for key, _, scorer in scorers}

    items = [Judged([a], [o], [s], [fl], [im]) for a, o, s, fl, im in
             zip(batch.attacks, batch.outputs, batch.seeds, batch.fields, batch.images)]
    return on_main(compute, items) if placement == "main" else compute(items)


def depends_on_image(scorer: Any) -> bool:
    """Whether a scorer's value can change with the rendered image: it reads the image, or the target's answer
    (``t2i_vlm``: the VLM's answer to that image)."""
    return bool(scorer.reads_image or scorer.reads_output)


def weighted_term(scorers: list[tuple[str, Any, Any]], scores: dict[str, torch.Tensor], use: str) -> torch.Tensor | None:
    """``(N,)`` the weighted sum of the gathered values of the scorers whose config says ``use`` (NaN where none
    scored); None when no scorer has that use."""
    parts = {key: scores[key].tolist() for key, s, _ in scorers if s.use == use}
    if not parts:
        return None
    weights = {key: s.weight for key, s, _ in scorers}
    return torch.tensor(combine(parts, weights), dtype=torch.float64)


def scorer_keys(scorers: list[Any]) -> list[tuple[str, Any]]:
    """Each scorer entry's score name ``use/name`` (``#2``, ... after a repeated one)."""
    out, seen = [], {}
    for s in scorers:
        key = f"{s.use}/{s.name}"
        seen[key] = seen.get(key, 0) + 1
        out.append((key if seen[key] == 1 else f"{key}#{seen[key]}", s))
    return out


class ScorerSet:
    """A section's scorer entries (``redteam.scorers``, ``flow_grpo.scorers``) built from :data:`SCORERS`, each under
    its score name (:func:`scorer_keys`): placed on a batch (:meth:`judge`) and weighted into a reward term
    (:meth:`term`). ``entries``: ``(score name, config entry, scorer)``."""

    def __init__(self, entries: list[tuple[str, Any, Scorer]]) -> None:
        self.entries = entries

    @classmethod
    def build(cls, configs: list[Any], model_cfg: Any) -> "ScorerSet":
        return cls([(key, s, build_scorer(s, model_cfg)) for key, s in scorer_keys(configs)])

    def where(self, keep: Callable[[Scorer], bool]) -> "ScorerSet":
        """The entries whose scorer ``keep`` accepts (e.g. :func:`depends_on_image`)."""
        return ScorerSet([x for x in self.entries if keep(x[2])])

    def judge(self, batch: Judged, device: torch.device, placement: str) -> dict[str, list[float]]:
        """Every scorer's values of this rank's samples (:func:`judge_placed`)."""
        return judge_placed(self.entries, batch, device, placement)

    def term(self, scores: dict[str, torch.Tensor], use: str) -> torch.Tensor | None:
        """``(N,)`` the weighted sum of the ``use`` scorers' gathered values (:func:`weighted_term`)."""
        return weighted_term(self.entries, scores, use)
