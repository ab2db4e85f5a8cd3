"""The semantic cache's lexical guard: a veto on hits between questions that differ where sentence
embeddings are blind.

A mean-pooled sentence embedding is close to a bag of words: "convert 5 kilograms to pounds" and
"convert 5 pounds to kilograms" score 0.993 with MiniLM, "opening hours on Sunday" and "on Saturday"
0.964 (benchmarks/cache_quality.py). Such pairs are the hard negatives a fixed threshold cannot separate from
paraphrases. The guard refuses a hit when the two questions
- mention different numbers (as multisets: "2025" vs "2024", "20%" vs "25%");
- send different things the other way round: the first content word after `to`/`into`, `from`,
  `before`, `after`, `than` differs ("string to integer" vs "integer to string");
- are the same sentence with one or two content words swapped for words the other lacks ("Sunday" for
  "Saturday", "ascending" for "descending"): a paraphrase rewords more than that, a different question
  often exactly that.
It is English-centred (its stop words and prepositions) and only ever turns a hit into a miss. On the
labelled set it keeps 1% false hits at a threshold that answers 31% of paraphrases, where without it no
threshold below 0.995 does (benchmarks/cache_quality.py, docs/benchmarks/cache_quality.md).
"""

from __future__ import annotations

import re

__all__ = ["may_share_answer"]

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[a-z0-9']+")
_DIRECTIONS = {"to": "to", "into": "to", "from": "from", "before": "before", "after": "after", "than": "than"}
_STOP = frozenset(
    (
        "a an the of to into from before after than in on for is are was be do does did i my me you your we "
        "our it its this that what whats what's how can could would should will please tell there which who "
        "when where why with at by as and or if any some much many"
    ).split()
)


def may_share_answer(cached: str, asked: str) -> bool:
    """False when the two questions differ in a way embeddings miss (see the module docstring)."""
    if sorted(_NUMBER.findall(cached)) != sorted(_NUMBER.findall(asked)):
        return False
    words_a, words_b = _words(cached), _words(asked)
    dirs_a, dirs_b = _directions(words_a), _directions(words_b)
    if dirs_a and dirs_b and dirs_a != dirs_b:
        return False
    content_a = [w for w in words_a if w not in _STOP]
    content_b = [w for w in words_b if w not in _STOP]
    if len(content_a) == len(content_b) and content_a != content_b:
        swapped = [(x, y) for x, y in zip(content_a, content_b, strict=True) if x != y]
        if len(swapped) <= 2 and all(x not in content_b and y not in content_a for x, y in swapped):
            return False
    return True


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower().replace("\u2019", "'"))


def _directions(words: list[str]) -> list[tuple[str, str]]:
    """Each direction word with the first content word after it, in one pass from the end (linear: a
    question of many prepositions and stop words must not cost quadratic time on the event loop)."""
    found = []
    following = ""  # the first content word after the current position
    for word in reversed(words):
        kind = _DIRECTIONS.get(word)
        if kind is not None:
            found.append((kind, following))
        if word not in _STOP:
            following = word
    return sorted(found)
