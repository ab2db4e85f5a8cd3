"""The semantic cache's parts on their own: the lexical guard's vetoes (and what it lets through), and the
index's answers against a brute-force search, flat and once a group has moved to an HNSW graph."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from corral.cache import SemanticIndex, guard
from corral.cache.guard import may_share_answer


@pytest.mark.parametrize(
    ("cached", "asked"),
    [
        ("Convert 5 kilograms to pounds", "Convert 5 pounds to kilograms"),  # direction swapped
        (
            "How do I convert a string to an integer in Python?",
            "How do I convert an integer to a string in Python?",
        ),
        ("What day of the week was July 4, 1976?", "What day of the week was July 4, 1977?"),  # numbers
        ("What is 20% of 50?", "What is 25% of 50?"),
        ("What are your store opening hours on Sunday?", "What are your store opening hours on Saturday?"),
        (
            "How do I sort results in descending order in SQL?",
            "How do I sort results in ascending order in SQL?",
        ),
        ("What date is 90 days after January 1?", "What date is 90 days before January 1?"),
    ],
)
def test_the_guard_vetoes_questions_that_differ_where_embeddings_are_blind(cached: str, asked: str) -> None:
    assert not may_share_answer(cached, asked)


@pytest.mark.parametrize(
    ("cached", "asked"),
    [
        ("What is the capital of France?", "whats the capital city of france?"),
        ("How do I count lines in a file in bash?", "bash command to count the number of lines in a file"),
        ("How do I convert a list to a set in Python?", "turning a python list into a set"),
        ("Which river in Africa is the longest?", "What is the longest river in Africa?"),
        ("Is 97 a prime number?", "Is the number 97 prime?"),
        ("Convert 10 miles to km", "convert 10 miles to km please"),
    ],
)
def test_the_guard_lets_paraphrases_through(cached: str, asked: str) -> None:
    assert may_share_answer(cached, asked)


def test_the_guards_price_a_one_word_rewording_is_refused_too() -> None:
    """ "tall" for "height" looks like "Saturday" for "Sunday" to the guard: the engine answers (a miss, never
    a wrong answer); benchmarks/cache_quality.py measures what this costs in hits."""
    assert not may_share_answer("How tall is Mount Everest?", "What is the height of Mount Everest?")


@pytest.mark.parametrize("hnsw_from", [10_000, 50])
async def test_the_index_finds_the_nearest_entry_of_the_group_only(hnsw_from: int) -> None:
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((300, 64)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = SemanticIndex(hnsw_from=hnsw_from)
    for i, vector in enumerate(vectors):
        await index.add("g1", f"k{i}", vector)
    await index.add("g2", "other", vectors[0])  # another group's identical vector is never an answer
    found = 0
    for i in range(0, 300, 7):
        query = vectors[i] + 0.05 * rng.standard_normal(64).astype(np.float32)
        query /= np.linalg.norm(query)
        neighbour = index.nearest("g1", query)
        assert neighbour is not None and neighbour.key != "other"
        found += neighbour.key == f"k{int(np.argmax(vectors @ query))}"
        assert abs(neighbour.similarity - float(vectors[int(neighbour.key[1:])] @ query)) < 1e-4
    assert found >= 42  # every one of the 43 queries: the flat search exactly, HNSW at this size too
    index.remove(["k0"])
    assert index.nearest("g1", vectors[0]).key != "k0"  # type: ignore[union-attr]
    assert len(index) == 300  # 299 of g1 and the one of g2
    index.remove([f"k{i}" for i in range(1, 160)])  # over half of the group: compacted
    assert len(index) == 141 and index.nearest("g1", vectors[200]).key == "k200"  # type: ignore[union-attr]
    await index.add("g1", "k0", vectors[0])  # a removed key may come back
    assert index.nearest("g1", vectors[0]).key == "k0"  # type: ignore[union-attr]
    index.remove(["k0"])
    index.remove([f"k{i}" for i in range(1, 300)])
    assert index.nearest("g1", vectors[5]) is None and index.nearest("g2", vectors[0]).key == "other"  # type: ignore[union-attr]


def _directions_by_definition(words: list[str]) -> list[tuple[str, str]]:
    """The guard's direction rule as the docstring states it (quadratic: for checking small inputs only)."""
    found = []
    for i, word in enumerate(words):
        if word in guard._DIRECTIONS:
            target = next((w for w in words[i + 1 :] if w not in guard._STOP), "")
            found.append((guard._DIRECTIONS[word], target))
    return sorted(found)


@given(st.lists(st.sampled_from(["to", "into", "from", "than", "the", "a", "string", "integer", "x"])))
def test_the_direction_rule_in_one_pass_is_the_rule_as_defined(words: list[str]) -> None:
    assert guard._directions(words) == _directions_by_definition(words)


def test_a_question_of_sixteen_thousand_words_is_checked_in_linear_time() -> None:
    """A hostile tenant's 16,000-word question of prepositions and stop words: the quadratic scan took
    8.7 s of the event loop; one pass takes milliseconds. Against a 1,000-word one timed in the same
    run (the best of three each, so a loaded machine does not decide): 16× the words cost about 18×
    the time in one pass, 256× in a quadratic scan."""

    def best_of_three(words: int) -> float:
        question = " ".join(["to", "the"] * (words // 2)) + " end"
        times = []
        for _ in range(3):
            began = time.perf_counter()
            assert may_share_answer(question, question)
            times.append(time.perf_counter() - began)
        return min(times)

    assert best_of_three(16_000) < 64 * best_of_three(1_000)


async def test_a_group_of_one_entry_holds_one_vector_not_sixteen() -> None:
    """Each distinct context (a seed, a max_tokens) starts a group: its matrix began at 16 rows, so a tenant
    sending one-entry contexts made the index hold 16 times the vectors' bytes, past the cache's byte
    bounds (which count only entries). It starts at one row and doubles."""
    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((2000, 384)).astype(np.float32)
    index = SemanticIndex()
    for i, vector in enumerate(vectors):
        await index.add(f"context-{i}", f"k{i}", vector)
    held = sum(group.matrix.nbytes for group in index._groups.values() if group.matrix is not None)
    assert held == vectors.nbytes
    for i, vector in enumerate(rng.standard_normal((40, 384)).astype(np.float32)):
        await index.add("context-0", f"more{i}", vector)
    assert index.nearest("context-0", vectors[0]).key == "k0"  # type: ignore[union-attr]
    assert index._groups["context-0"].matrix.shape[0] == 64  # type: ignore[union-attr]  # 41 rows: doubled
