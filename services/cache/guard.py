"""Near-hit guard: a cheap lexical check run on semantic-cache candidates above the threshold.

Sentence embeddings put "how do I enable X" and "how do I disable X", or "flights to Paris in
2023" and "... in 2024", very close together. The guard refuses a candidate whose question
differs from the asked one in negation, numbers, named entities, a known antonym, word order
around a direction word, or in its literal structure (brackets, braces, quotes, operators, and the
layout of text that has lines: code, data); the caller counts each refusal by reason. It only
ever turns hits into misses.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

REASONS = ("negation", "number", "entity", "antonym", "order", "literal")

# Characters that give text a structure its words do not: `(()` and `(())`, JSON with and without
# its closing brace, a quoted and an unquoted string, `a = b` and `a == b`, `C` and `C++`.
LITERAL_CHARS = frozenset('()[]{}<>"\u201c\u201d\u201e\u00ab\u00bb`=+*^|&\\~#@;')
_WHITESPACE_RUN = re.compile(r"\s+")

NEGATIONS = frozenset(
    """not no never none nobody nothing nowhere neither nor without cannot cant dont doesnt didnt isnt
    arent wasnt werent wont wouldnt shouldnt couldnt hasnt havent hadnt mustnt neednt aint non
    unable excluding except""".split()
)

NUMBER_WORDS = {
    "zero": "0",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
    "eleven": "11",
    "twelve": "12",
    "thirteen": "13",
    "fourteen": "14",
    "fifteen": "15",
    "sixteen": "16",
    "seventeen": "17",
    "eighteen": "18",
    "nineteen": "19",
    "twenty": "20",
    "thirty": "30",
    "forty": "40",
    "fifty": "50",
    "sixty": "60",
    "seventy": "70",
    "eighty": "80",
    "ninety": "90",
    "hundred": "100",
    "thousand": "1000",
    "million": "1000000",
    "billion": "1000000000",
    "dozen": "12",
    "first": "1",
    "third": "3",
    "fourth": "4",
    "fifth": "5",
    "sixth": "6",
    "seventh": "7",
    "eighth": "8",
    "ninth": "9",
    "tenth": "10",
    "twice": "2",
    "half": "0.5",
    "double": "2",
    "triple": "3",
}

# Each pair: questions that differ only by one of these words usually ask opposite things.
ANTONYM_PAIRS = (
    ("increase", "decrease"),
    ("increases", "decreases"),
    ("raise", "lower"),
    ("higher", "lower"),
    ("more", "less"),
    ("more", "fewer"),
    ("most", "least"),
    ("max", "min"),
    ("maximum", "minimum"),
    ("largest", "smallest"),
    ("biggest", "smallest"),
    ("bigger", "smaller"),
    ("larger", "smaller"),
    ("longest", "shortest"),
    ("longer", "shorter"),
    ("tallest", "shortest"),
    ("oldest", "youngest"),
    ("older", "younger"),
    ("oldest", "newest"),
    ("older", "newer"),
    ("best", "worst"),
    ("better", "worse"),
    ("before", "after"),
    ("first", "last"),
    ("start", "end"),
    ("start", "stop"),
    ("begin", "end"),
    ("open", "close"),
    ("enable", "disable"),
    ("enabled", "disabled"),
    ("add", "remove"),
    ("install", "uninstall"),
    ("import", "export"),
    ("upload", "download"),
    ("buy", "sell"),
    ("win", "lose"),
    ("won", "lost"),
    ("hot", "cold"),
    ("warm", "cold"),
    ("true", "false"),
    ("legal", "illegal"),
    ("safe", "dangerous"),
    ("safe", "unsafe"),
    ("encrypt", "decrypt"),
    ("input", "output"),
    ("ascending", "descending"),
    ("north", "south"),
    ("east", "west"),
    ("left", "right"),
    ("inside", "outside"),
    ("above", "below"),
    ("over", "under"),
    ("push", "pull"),
    ("send", "receive"),
    ("cheapest", "expensive"),
    ("cheap", "expensive"),
    ("fastest", "slowest"),
    ("faster", "slower"),
    ("fast", "slow"),
    ("easy", "hard"),
    ("easiest", "hardest"),
    ("heavy", "light"),
    ("heaviest", "lightest"),
    ("rich", "poor"),
    ("richest", "poorest"),
    ("advantages", "disadvantages"),
    ("pros", "cons"),
    ("benefits", "risks"),
    ("benefits", "drawbacks"),
    ("strengths", "weaknesses"),
    ("success", "failure"),
    ("accept", "reject"),
    ("allow", "block"),
    ("allow", "deny"),
    ("allowed", "forbidden"),
    ("login", "logout"),
    ("lock", "unlock"),
    ("mount", "unmount"),
    ("compress", "decompress"),
    ("serialize", "deserialize"),
    ("encode", "decode"),
    ("connect", "disconnect"),
    ("subscribe", "unsubscribe"),
    ("join", "leave"),
    ("arrive", "depart"),
    ("arrival", "departure"),
    ("import", "export"),
    ("imports", "exports"),
    ("sunrise", "sunset"),
    ("morning", "evening"),
    ("day", "night"),
    ("summer", "winter"),
    ("spring", "autumn"),
    ("male", "female"),
    ("men", "women"),
    ("boys", "girls"),
    ("positive", "negative"),
    ("upper", "lower"),
    ("uppercase", "lowercase"),
    ("plus", "minus"),
    ("add", "subtract"),
    ("multiply", "divide"),
    ("celsius", "fahrenheit"),
    ("kilometers", "miles"),
    ("meters", "feet"),
    ("kg", "pounds"),
    ("internal", "external"),
    ("public", "private"),
    ("client", "server"),
    ("frontend", "backend"),
    ("read", "write"),
    ("always", "sometimes"),
    ("all", "some"),
    ("everyone", "someone"),
    ("yes", "no"),
    ("agree", "disagree"),
    ("like", "dislike"),
    ("love", "hate"),
    ("cause", "cure"),
    ("causes", "cures"),
    ("prevent", "cause"),
    ("minimum", "max"),
    ("min", "maximum"),
    ("past", "future"),
    ("yesterday", "tomorrow"),
    ("previous", "next"),
    ("last", "next"),
    ("wet", "dry"),
    ("full", "empty"),
    ("dark", "light"),
    ("sweet", "sour"),
    ("young", "old"),
    ("new", "old"),
    ("lowest", "highest"),
    ("rise", "fall"),
    ("gain", "loss"),
    ("profit", "loss"),
    ("credit", "debit"),
    ("deposit", "withdraw"),
    ("on", "off"),
    ("up", "down"),
    ("asleep", "awake"),
    ("sleep", "wake"),
    ("pass", "fail"),
    ("passed", "failed"),
)

# Capitalized words that start a sentence without naming anything.
COMMON_WORDS = frozenset(
    """a an the i me my we our you your he she it its they their them this that these those there here
    what which who whom whose why how when where whats hows whos wheres whens whys is are was were be been
    being am do does did done have has had can could should would will shall may might must need needs
    please tell explain describe list give show compare define write summarize translate find calculate
    convert recommend suggest name help let lets make create get set use using in on at for to from of by
    with about into over under and or but so if then also any some all every each both either best most
    many much few several tips ways way hey hi hello ok okay yes no not why difference differences
    quick simple good easy one two three four five six seven eight nine ten first second next
    last other another such same different just only even still really actually generally usually
    typically approximately roughly exactly often sometimes always never according based due""".split()
)

_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "`": "'"})
_WORD_RE = re.compile(r"[^\W_]+(?:['\-.][^\W_]+)*")
_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)*")
_SENTENCE_END = frozenset(".!?:;\n")


# A question with one of these reads in a direction: "convert A to B", "is A faster than B".
DIRECTIONAL = frozenset("to into from than vs versus over before after per".split())
STOPWORDS = frozenset(
    """a an the i me my we you your it its is are was were be do does did how what which who why when where
    can could should would will shall may might must of in on at for with by about and or""".split()
)


@dataclass(frozen=True)
class Features:
    """What the guard compares, computed once per question."""

    sequence: tuple[str, ...]
    words: frozenset[str]
    counts: Counter[str]
    negations: int
    numbers: Counter[str]
    entities: frozenset[str]
    # The structural characters in order, and for text with lines (code, data) its whitespace.
    literal: tuple[str, ...] = ()
    layout: tuple[str, ...] | None = None


def _number(raw: str) -> str:
    if "," in raw and "." not in raw and all(len(g) == 3 for g in raw.split(",")[1:]):
        raw = raw.replace(",", "")  # 1,000 -> 1000
    raw = raw.replace(",", ".")
    if "." in raw:
        raw = raw.rstrip("0").rstrip(".") or "0"
    return raw.lstrip("0") or "0"


def features(text: str) -> Features:
    raw = unicodedata.normalize("NFKC", text)
    # Before backticks become apostrophes: `ls -a` and ls -a differ.
    literal = tuple(c for c in raw if c in LITERAL_CHARS)
    text = raw.translate(_APOSTROPHES)
    words: list[str] = []
    negations = 0
    numbers: Counter[str] = Counter(_number(m) for m in _NUMBER_RE.findall(text))
    entities: set[str] = set()
    prev_end = 0
    for i, match in enumerate(_WORD_RE.finditer(text)):
        sentence_start = i == 0 or any(ch in _SENTENCE_END for ch in text[prev_end : match.start()])
        prev_end = match.end()
        token = match.group(0)
        low = token.casefold().removesuffix("'s")
        words.append(low)
        if "-" in low or "." in low:
            words.extend(p for p in re.split(r"[-.]", low) if p)
        if low.replace("'", "") in NEGATIONS or low.endswith("n't"):
            negations += 1
        if low in NUMBER_WORDS:
            numbers[NUMBER_WORDS[low]] += 1
        if _is_entity(token, sentence_start):
            entities.add(low)
    sequence = tuple(w for w in words if w not in STOPWORDS)
    layout = tuple(_WHITESPACE_RUN.findall(text.strip())) if ("\n" in text.strip() or "\t" in text) else None
    return Features(
        sequence, frozenset(words), Counter(words), negations, numbers, frozenset(entities), literal, layout
    )


def _is_entity(token: str, sentence_start: bool) -> bool:
    letters = [c for c in token if c.isalpha()]
    if not letters or token == "I" or token.startswith(("I'", "i'")):
        return False
    if len(letters) >= 2 and all(c.isupper() for c in letters):
        return True  # acronym: AWS, GPU, NYC
    if any(c.isupper() for c in token[1:]):
        return True  # iPhone, PostgreSQL, McDonald
    if not token[0].isupper():
        return False
    if sentence_start:
        if token.casefold().endswith("ing"):
            return False  # "Sorting a dict ...", "Installing ..."
        return token.casefold().replace("'", "") not in COMMON_WORDS and token.casefold() not in COMMON_WORDS
    return True


_ANTONYMS: dict[str, frozenset[str]] = {}
for _a, _b in ANTONYM_PAIRS:
    _ANTONYMS[_a] = _ANTONYMS.get(_a, frozenset()) | {_b}
    _ANTONYMS[_b] = _ANTONYMS.get(_b, frozenset()) | {_a}


def check(asked: str | Features, cached: str | Features) -> str | None:
    """None when the cached question may answer the asked one; otherwise the refusal reason."""
    a = asked if isinstance(asked, Features) else features(asked)
    b = cached if isinstance(cached, Features) else features(cached)
    if a.literal != b.literal or a.layout != b.layout:
        return "literal"
    if a.negations != b.negations:
        return "negation"
    if a.numbers != b.numbers:
        return "number"
    # An entity of one question that the other does not mention at all (in any case).
    if (a.entities - b.words) or (b.entities - a.words):
        return "entity"
    only_a, only_b = a.counts - b.counts, b.counts - a.counts
    for word in only_a:
        if _ANTONYMS.get(word, frozenset()) & only_b.keys():
            return "antonym"
    # Same words in another order around a direction word: "A to B" against "B to A".
    if a.words == b.words and a.sequence != b.sequence and a.words & DIRECTIONAL:
        if sorted(a.sequence) == sorted(b.sequence):
            return "order"
    return None
