"""Regenerate the resources shipped in ``src/alignkit/resources/``: the tokenizer corpus and data sets.

Usage (from the repository root)::

    PYTHONPATH=src python scripts/make_resources.py [--check-vocab 8192]

Everything is seeded, so running it twice writes byte-identical files. The corpus mixes the
special-token-free rendering of the synthetic tasks (so every word, digit and role name they use is
learned), the toy safety world, hand-written English paragraphs and a list of common English words
with their inflections (variety, so a byte-level BPE can reach a vocabulary of 8192).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from alignkit.data import synth  # noqa: E402

RESOURCES = REPO / "src" / "alignkit" / "resources"

#: name -> (kind, n, seed, split). Train and eval use different seeds *and* disjoint question sets.
DATASETS: dict[str, tuple[str, int, int, str]] = {
    "sft_train.jsonl": ("sft", 2000, 1, "train"),
    "sft_train.parquet": ("sft", 2000, 1, "train"),
    "sft_eval.jsonl": ("sft", 200, 2, "eval"),
    "sft_pc_train.jsonl": ("sft-pc", 500, 3, "train"),
    "pref_train.jsonl": ("pref", 2000, 4, "train"),
    "pref_eval.jsonl": ("pref", 200, 5, "eval"),
    "safety_train.jsonl": ("safety", 2000, 6, "train"),
    "safety_eval.jsonl": ("safety", 200, 7, "eval"),
}
#: the online algorithms' digit task (name -> kind, n, seed, split); the tasks are "digits" only
DIGIT_DATASETS: dict[str, tuple[str, int, int, str]] = {
    "digits_sft_train.jsonl": ("sft", 2000, 8, "train"),
    "digits_prompts_train.jsonl": ("prompts", 1000, 9, "train"),
    "digits_prompts_eval.jsonl": ("prompts", 100, 10, "eval"),
}
#: the calculator tool-use task of grpo_agent (data/synth_agents.py)
AGENT_DATASETS: dict[str, tuple[str, int, int, str]] = {
    "calculator_sft_train.jsonl": ("calculator-sft", 2000, 11, "train"),
    "calculator_prompts_train.jsonl": ("calculator-prompts", 1000, 12, "train"),
    "calculator_prompts_eval.jsonl": ("calculator-prompts", 100, 13, "eval"),
    "calc_sft_train.jsonl": ("calc-sft", 2000, 14, "train"),  # the recipe's: 2-digit products, the short call
    "calc_prompts_train.jsonl": ("calc-prompts", 2000, 15, "train"),
    "calc_prompts_eval.jsonl": ("calc-prompts", 64, 16, "eval"),
}

PARAGRAPHS = """\
Alignment is the work of teaching a language model to be helpful, honest and harmless. A model is first
trained to predict the next token of a large amount of text. It then learns from demonstrations, where
people write good answers to many questions, and from comparisons, where a person reads two answers and
says which one is better. A reward model learns to score answers the way people do, and a policy is
then tuned to earn a high score without drifting too far from where it started.

The weather changed quickly that afternoon. Dark clouds rolled over the hills, the wind picked up, and
the first heavy drops of rain hit the windows of the old farmhouse. Children ran inside, laughing, with
muddy boots and wet hair. Their grandmother lit the stove, put a kettle on, and told them a story about
the winter when the river froze so thick that the whole village walked across it to the market.

To make a simple vegetable soup, chop an onion, two carrots and a stick of celery. Warm a spoonful of
olive oil in a large pot and cook the onion until it is soft. Add the carrots, the celery, a few
potatoes and enough water or stock to cover everything. Season with salt and pepper, let it simmer for
twenty minutes, and taste it before serving. Fresh bread and a little cheese make it a complete meal.

Computers store numbers in binary, a system that uses only two digits. Each position is worth twice the
one to its right, so the binary number one zero one means five. Adding binary numbers works like adding
decimal numbers: you add each column, write down the last digit, and carry the rest to the next column.
Early machines filled whole rooms, while a modern phone holds billions of tiny switches on one chip.

The library opened at nine every morning. Students came to study for their exams, retired teachers read
newspapers by the window, and a small group of friends met every Thursday to talk about a novel they had
all agreed to read. The librarian knew almost everyone by name. She recommended mysteries to the quiet
man in the grey coat and science fiction to the girl who always asked about the stars.

Good software is written to be read. Clear names, short functions and tests that explain the intent make
it easier for the next person to change the code safely. When something breaks, a careful engineer
first reproduces the problem, then writes a test that fails, and only then fixes the bug. Reviews catch
mistakes, but they also spread knowledge, so that no part of a system is understood by only one person.

Birds migrate over enormous distances. Some small songbirds fly across deserts and seas, guided by the
sun, the stars and the magnetic field of the earth. Before the journey they eat constantly and store fat
as fuel. Scientists follow them with tiny trackers and have learned that many birds return to the very
same garden, year after year, after travelling thousands of kilometres.

Please be kind to one another. Say thank you, listen when someone speaks, and ask before you borrow
something. If you are not sure what to do, it is fine to ask for help. Everyone makes mistakes; what
matters is that we learn from them, apologise when we hurt someone, and try to do better tomorrow.

History is full of surprising connections. Paper travelled from China along trade routes to the Middle
East and then to Europe, where printing presses made books cheap enough for ordinary families. Ideas
spread faster than ever before. Maps improved, sailors explored new coasts, and letters carried news of
discoveries between scholars who had never met but argued and agreed across great distances.

A question and its answer: what is the capital of France? The capital of France is Paris. How many days
are in a week? There are seven days in a week. Which planet is closest to the sun? Mercury is the
closest planet to the sun. Why is the sky blue? Sunlight is scattered by the air, and blue light is
scattered more than red light, so the sky looks blue during the day.
"""

# Common English words; inflected below to give the BPE enough distinct words to reach 8192 merges.
NOUNS = """
time year people way day man woman child world life hand part eye place work week case point number
group problem fact question answer idea story water room mother father friend family school student
teacher book letter word name city country village town road street house home door window table chair
garden tree flower plant seed leaf river lake sea ocean island mountain hill valley forest field farm
animal horse bird fish insect bee ant spider rabbit mouse lion tiger bear wolf fox deer sheep goat cow
pig chicken duck egg bread cheese butter apple orange banana lemon grape cherry potato tomato carrot
onion garlic pepper salt sugar honey coffee tea juice soup cake cookie kitchen plate cup glass bottle
knife fork spoon bowl pot pan oven stove fridge bed pillow blanket lamp clock phone computer screen
keyboard program machine engine car bus train plane boat bicycle wheel ticket station airport bridge
tunnel tower castle palace temple church market shop store bank office factory hospital doctor nurse
farmer baker driver pilot sailor soldier artist singer writer painter player dancer worker manager
leader king queen prince princess hero monster dragon giant wizard ghost robot planet star moon sun
sky cloud rain snow storm wind thunder lightning season spring summer autumn winter morning evening
night noon hour minute second moment history science music art language picture song poem game sport
ball team match race goal prize gift party holiday birthday wedding festival dream memory thought
feeling reason choice change chance danger safety health body head face nose mouth ear tooth arm leg
foot finger heart blood bone skin hair voice smile tear laugh color shape size weight height length
distance speed price money coin paper pencil pen brush paint stone rock sand metal gold silver iron
wood glass plastic cloth shirt dress coat hat shoe sock boot bag box basket rope chain key lock wall
floor roof corner edge side top bottom middle center circle square line dot pattern map compass
journey path trip adventure mystery secret problem solution method result reward lesson rule law
"""
VERBS = """
walk talk jump climb run swim fly drive ride read write draw paint sing dance play work rest sleep
wake eat drink cook bake wash clean open close start finish begin stop help ask answer call shout
whisper listen hear watch look see smile laugh cry love like hate want need try learn teach study
remember forget think believe know understand explain describe follow lead carry bring send receive
give take buy sell pay borrow lend build break fix move turn push pull throw catch kick hold drop
lift pick fill pour mix stir cut chop slice fold wrap tie plant grow water feed visit travel arrive
leave return enter exit wait hurry check count measure compare choose decide plan prepare practise
improve change create design test train reward score rank judge agree argue discuss share collect
keep save spend waste lose win fight protect attack defend hide search find discover explore invent
imagine wonder worry hope wish promise offer refuse accept allow forbid warn guide show point print
"""
ADJECTIVES = """
big small large tiny huge long short tall wide narrow thick thin heavy light dark bright warm cold
hot cool wet dry clean dirty new old young fresh quick slow fast early late easy hard soft loud quiet
happy sad angry calm brave kind cruel gentle rough smooth sharp sweet sour bitter rich poor strong weak
simple clever wise silly strange common rare safe dangerous helpful honest harmless careful busy free
full empty open closed near far deep high low round flat square green blue red yellow purple orange
"""


def _inflect(word: str, kind: str) -> list[str]:
    """Rough English inflections: enough to give the BPE realistic word endings to merge."""
    stem = word[:-1] if word.endswith("e") else word
    if kind == "noun":
        return [word, word + ("es" if word.endswith(("s", "x", "ch", "sh")) else "s")]
    if kind == "verb":
        forms = [word, word + "s", stem + "ed", stem + "ing", stem + "er"]
        return forms + ["re" + f for f in forms[:4]]
    forms = [word, stem + "er", stem + "est", word + "ly", word + "ness"]
    return forms + ["un" + f for f in (word, word + "ly")]


def _word_lines(rng: random.Random) -> list[str]:
    """Sentences from the word lists, each word in several forms and cases."""
    forms = [f for w in NOUNS.split() for f in _inflect(w, "noun")]
    forms += [f for w in VERBS.split() for f in _inflect(w, "verb")]
    forms += [f for w in ADJECTIVES.split() for f in _inflect(w, "adj")]
    forms += [f.capitalize() for f in forms] + [f.upper() for f in forms[::7]]
    rng.shuffle(forms)
    return [" ".join(forms[i:i + 12]) + "." for i in range(0, len(forms), 12)]


def _task_lines(rng_seed: int) -> list[str]:
    """The synthetic tasks rendered the way the chat template lays them out, minus special tokens."""
    lines: list[str] = []
    for row in synth.make_sft_rows(3000, rng_seed, split="train"):
        for m in row["messages"]:
            lines += [m["role"], m["content"]]
    for row in synth.make_preference_rows(500, rng_seed + 1, split="train"):
        lines += ["user", row["prompt"], "assistant", row["rejected"]]
    for row in synth.make_safety_rows(600, rng_seed + 2, split="train"):
        lines += ["system", "You are a helpful and harmless assistant.", "user", row["prompt"],
                  "assistant", row["response_0"], "assistant", row["response_1"]]
    return lines


def build_corpus() -> str:
    """The whole tokenizer corpus as one string (deterministic)."""
    rng = random.Random(0)
    parts = _task_lines(100) + [PARAGRAPHS] + _word_lines(rng)
    # Upper- and lower-case alphabets and digits in every spacing the tasks use.
    letters = "abcdefghijklmnopqrstuvwxyz"
    parts += [" ".join(letters), " ".join(letters.upper()), letters, letters.upper(), "0 1 2 3 4 5 6 7 8 9"]
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-vocab", type=int, default=8192, help="train a tokenizer and print its size")
    args = parser.parse_args()
    corpus = build_corpus()
    path = RESOURCES / "corpus.txt"
    path.write_text(corpus, encoding="utf-8")
    print(f"wrote {path} ({len(corpus.encode('utf-8')) / 1024:.0f} KiB)")
    for name, (kind, n, seed, split) in {**DATASETS, **AGENT_DATASETS}.items():
        out = synth.generate(kind, n, seed, RESOURCES / "data" / name, split=split)
        print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB, {n} rows)")
    for name, (kind, n, seed, split) in DIGIT_DATASETS.items():
        out = synth.generate(kind, n, seed, RESOURCES / "data" / name, split=split, tasks=["digits"])
        print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB, {n} rows)")
    if args.check_vocab:
        from alignkit.models.tiny_base import train_tokenizer

        tok = train_tokenizer(args.check_vocab, corpus=path)
        print(f"tokenizer: asked for {args.check_vocab}, got len(tokenizer) = {len(tok)}")


if __name__ == "__main__":
    main()
