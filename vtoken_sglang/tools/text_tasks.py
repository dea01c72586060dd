"""Quality tasks on real text for pretrained checkpoints: pass-key retrieval and copying a fact out of prose.

Prompts are plain completions in the model's own tokenizer (no chat template: a small instruct model finds the key
more often without it), each ending with a cue the answer continues. Two layouts alternate (even index: question
first, odd: question at the end), so that a policy which keeps the question's tokens (sinks) or observes it
(SnapKV's window) shows the difference:

- ``passkey``: filler sentences (in a fresh order per round, so no two prompts share a document) to the target
  length, one needle ``The pass key is NNNNN. Remember it.
  NNNNN is the pass key.`` at a random sentence boundary; the answer is the 5 digits.
- ``prose``: paragraphs of hand-written prose (``PARAGRAPHS``), shuffled, each naming a different invented person
  in its fact sentence (so every name but one is a distractor), until the target length; the question repeats one
  paragraph's cue (``... was kept by``) and the answer is that paragraph's name. All of them fill about 900 tokens
  of SmolLM2's tokenizer: a larger target gives that.

``TextPrompt.correct(text)``: the decoded output, stripped, starts with the answer (pass key: its first run of
digits equals the key). Seeded: the same (task, tokenizer, target, count, seed) gives the same prompts.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable

FILLER = ("The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. ", "There and back again. ")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_CUE = " The pass key is"

# paragraphs of prose, each with one fact sentence naming someone after a role of its own (``... by the ferryman
# {name}``): a prompt's question repeats that sentence up to the name (``cue``)
PARAGRAPHS: tuple[str, ...] = (
    "On the northern cape stood a lighthouse of grey stone, its lamp turned by a clockwork that had to be "
    "wound every four hours. Through the long winters, the lighthouse on the northern cape was kept by the "
    "lighthouse keeper {name}, who logged every passing ship in a leather book and repainted the railings "
    "each spring.",
    "The village bakery opened before dawn, and the smell of rye bread drifted down to the harbour while the "
    "fishing boats were still tied up. Its oven, built of bricks from the old mill, was lit each morning by "
    "the master baker {name}, who never once let the fire go out in thirty years.",
    "A narrow bridge of rope and planks crossed the gorge above the river, swaying whenever the wind came "
    "down from the pass. After the spring floods, the rope bridge across the gorge was rebuilt by the "
    "carpenter {name}, who carried the new planks up the mountain on a mule.",
    "The town library had a reading room with tall windows and a clock that ran seven minutes fast. The rare "
    "maps in the basement archive were catalogued by the archivist {name}, who wrote every entry by hand on "
    "small cards of yellow paper.",
    "Every autumn the orchard on the hill produced more apples than the valley could eat, so the surplus was "
    "pressed into cider. The oldest pear tree in the orchard was planted by the gardener {name}, and it still "
    "gives fruit although its trunk is hollow.",
    "The observatory sat on a ridge far from the city lights, and on clear nights its dome opened with a "
    "groan of iron wheels. The comet that appeared in the eastern sky that year was first noticed by the "
    "astronomer {name}, who stayed awake until sunrise to measure its tail.",
    "The river ferry carried carts, cattle and travellers from one bank to the other, pulled along a cable "
    "stretched between two posts. In the year of the great storm, the river ferry was steered by the ferryman "
    "{name}, who refused to stop running it even when the water rose.",
    "Behind the school there was a garden where the children grew beans, onions and sunflowers taller than "
    "the fence. The school's small museum of fossils was collected by the schoolteacher {name}, who found "
    "most of the shells on the cliffs south of the town.",
    "The railway station was built of red brick, with a roof of glass that leaked whenever it rained hard. "
    "The great clock above the platform was repaired by the clockmaker {name}, who climbed the ladder every "
    "Sunday to oil its gears.",
    "In the market square a stone fountain ran all year, fed by a spring that had never been known to freeze. "
    "The bronze statue of a fox beside the fountain was cast by the sculptor {name}, whose workshop stood at "
    "the end of the tanners' lane.",
    "The mountain hut had twelve bunks, a wood stove and a shelf of books left behind by walkers. On the "
    "night of the avalanche, the lost climbers were guided down to the hut by the mountain guide {name}, who "
    "knew every path on the mountain in the dark.",
    "The island's post arrived twice a week on a small boat, and letters were sorted in the back room of the "
    "only shop. The island's first telephone line was laid by the telegraph engineer {name}, who spent a "
    "whole summer stringing the wire from pole to pole.",
    "The old theatre had red velvet seats, a painted ceiling and a stage that creaked under the actors' "
    "boots. The curtain with the golden birds was sewn by the seamstress {name}, who worked on it every "
    "evening for two winters.",
    "Sheep grazed on the moor above the village, and in June the whole valley helped with the shearing. The "
    "stone wall that runs along the top of the moor was built by the stonemason {name}, who set every stone "
    "without mortar.",
    "The hospital on the hill began as a single ward with eight beds and a kitchen garden. Its first "
    "operating theatre was designed by the architect {name}, who insisted on windows facing north for an even "
    "light.",
    "A windmill on the marsh pumped water out of the fields, its sails turning day and night in the autumn "
    "gales. The windmill's broken sails were replaced by the millwright {name}, who had learned the trade "
    "from an uncle on the coast.",
)
FIRST_NAMES = (
    "Anna", "Bruno", "Clara", "Daniel", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jonas", "Karen", "Leon",
    "Martha", "Nils", "Olga", "Peter", "Rosa", "Simon", "Tessa", "Victor", "Walter", "Yvonne",
)  # fmt: skip
LAST_NAMES = (
    "Albright", "Brennan", "Castell", "Dunmore", "Ellery", "Fairbank", "Garland", "Harlow", "Ingram", "Jessop",
    "Kendrick", "Lowell", "Marlow", "Northcott", "Oakley", "Pembroke", "Quinlan", "Radley", "Stanton", "Thorne",
)  # fmt: skip
PROSE_INTRO = "Read the stories below. A question asks who did something in one of them.\n\n"
TASKS = ("passkey", "prose")


@dataclasses.dataclass(frozen=True)
class TextPrompt:
    ids: list[int]
    answer: str
    question_first: bool
    depth: float  # where the needle (pass key or asked paragraph) starts, as a share of the document

    def correct(self, text: str) -> bool:
        """The model's decoded continuation answers exactly (pass key: its first digit run is the key)."""
        if self.answer.isdigit():
            digits = re.search(r"\d+", text)
            return digits is not None and digits.group() == self.answer
        return text.strip().startswith(self.answer)


def _fill(pieces: list[str], count: Callable[[str], int], target: int, frame: Callable[[str], str], cycle: bool) -> str:
    """The longest prefix of ``pieces`` (cycled if ``cycle``, else at most all of them once) whose framed text stays
    within ``target`` tokens."""
    doc, i = "", 0
    while cycle or i < len(pieces):
        longer = doc + pieces[i % len(pieces)]
        if count(frame(longer)) > target:
            break
        doc, i = longer, i + 1
    return doc


def passkey_prompt(tok, target: int, rng: random.Random, question_first: bool) -> TextPrompt:
    key = str(rng.randrange(10_000, 100_000))
    needle = PASSKEY_NEEDLE.format(key=key)
    if question_first:
        head, tail = f"{PASSKEY_QUESTION} {PASSKEY_INTRO}\n\n", f"\n\n{PASSKEY_CUE.strip()}"
    else:
        head, tail = f"{PASSKEY_INTRO}\n\n", f"\n\n{PASSKEY_QUESTION}{PASSKEY_CUE}"
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    # the filler's sentences in a fresh order every round: prompts share no more than their opening words
    rounds = target // 20 + 1  # a round is about 25 tokens
    pieces = [piece for _ in range(rounds) for piece in rng.sample(FILLER, len(FILLER))]
    filler = _fill(pieces, count, target - count(needle), lambda d: head + d + tail, cycle=False)
    used = pieces[: filler.count(". ")]  # each piece ends with the one ". " it holds
    cut = rng.randrange(len(used) + 1)
    doc = "".join(used[:cut]) + needle + "".join(used[cut:])
    text = head + doc.rstrip() + tail
    depth = round(len("".join(used[:cut])) / max(len(doc), 1), 3)
    return TextPrompt(tok.encode(text, add_special_tokens=False), key, question_first, depth)


def cue(paragraph: str) -> str:
    """The paragraph's fact sentence up to its name (``... by the ferryman``)."""
    before = paragraph.split("{name}")[0]
    return before[before.rfind(". ") + 2 :].strip()


def prose_prompt(tok, target: int, rng: random.Random, question_first: bool) -> TextPrompt:
    order = rng.sample(PARAGRAPHS, len(PARAGRAPHS))
    people = [f"{f} {last}" for f, last in zip(rng.sample(FIRST_NAMES, len(order)), rng.sample(LAST_NAMES, len(order)))]
    paragraphs = [p.format(name=who) + "\n\n" for p, who in zip(order, people)]

    def text(doc: str, asked: str) -> str:
        if question_first:
            return f"{PROSE_INTRO}Question: {asked} whom?\n\n{doc}Answer: {asked}"
        return f"{PROSE_INTRO}{doc}Question: complete the sentence with the person's full name.\nAnswer: {asked}"

    longest = max(map(cue, PARAGRAPHS), key=len)
    count = lambda doc: len(tok.encode(text(doc, longest), add_special_tokens=False))  # noqa: E731
    doc = _fill(paragraphs, count, target, lambda d: d, cycle=False)  # each paragraph at most once: ~900 tokens
    used = doc.count("\n\n")
    if used < 2:
        raise ValueError(f"prose task: a target of {target} tokens fits fewer than two paragraphs")
    asked = rng.randrange(used)
    depth = round(sum(len(p) for p in paragraphs[:asked]) / max(len(doc), 1), 3)
    ids = tok.encode(text(doc, cue(order[asked])), add_special_tokens=False)
    return TextPrompt(ids, people[asked], question_first, depth)


def prompts(task: str, tok, target: int, count: int, seed: int) -> list[TextPrompt]:
    """``count`` prompts of about ``target`` tokens (at most), layouts alternating (question first at even
    indices)."""
    build = {"passkey": passkey_prompt, "prose": prose_prompt}.get(task)
    if build is None:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    rng = random.Random(seed)
    return [build(tok, target, rng, i % 2 == 0) for i in range(count)]
