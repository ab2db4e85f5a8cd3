"""An engine's usage as the gateway counts it (protocol/usage.py): whole numbers from 0 to MOST_TOKENS, or
nothing to count with."""

from __future__ import annotations

import math

import pytest

from corral.protocol.usage import MOST_TOKENS, engine_usage


def test_counts_are_read_as_whole_numbers_and_the_total_is_never_below_its_parts() -> None:
    assert engine_usage({"prompt_tokens": 9, "completion_tokens": 3.0, "total_tokens": 12}) == {
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "total_tokens": 12,
    }
    assert engine_usage({"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 1})["total_tokens"] == 12
    assert engine_usage({"prompt_tokens": 9})["total_tokens"] == 9  # (an absent count is 0)
    details = engine_usage(
        {
            "prompt_tokens": 9,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": "many"},
        }
    )
    assert details == {
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


@pytest.mark.parametrize(
    "count", ["5", -1, MOST_TOKENS + 1, 2**70, 1.5, math.inf, math.nan, True, [1], {"n": 1}]
)
def test_a_count_that_is_no_count_leaves_nothing_to_count_with(count: object) -> None:
    assert engine_usage({"prompt_tokens": count, "completion_tokens": 1}) is None
    assert engine_usage({"prompt_tokens": 1, "completion_tokens": count}) is None


@pytest.mark.parametrize("value", [None, [1, 2], "usage", 7])
def test_a_usage_that_is_no_object_is_none(value: object) -> None:
    assert engine_usage(value) is None
