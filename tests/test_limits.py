"""ipuserve.limits states the wire's name and duration rules without the wire; the
protocol enforces the same ones at decode, so the two must never drift apart."""

from __future__ import annotations

from typing import Any

import pytest

from ipuserve import limits
from ipuserve import protocol as wire


def test_the_protocol_carries_the_same_limits() -> None:
    assert (wire.MAX_NAME_CHARS, wire.MAX_DURATION_MS) == (
        limits.MAX_NAME_CHARS,
        limits.MAX_DURATION_MS,
    )


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("resnet", None),
        ("é" * 256, None),
        ("", "must have 1..256 characters; got 0"),
        ("x" * 257, "must have 1..256 characters; got 257"),
        (7, "must be a string of 1..256 characters, not a int"),
        ("\ud800", "must be UTF-8 text; '\\ud800' holds a lone surrogate"),
    ],
)
def test_a_name_is_judged_alike_by_both(value: Any, problem: str | None) -> None:
    assert limits.name_problem(value) == problem
    assert wire.name_problem(value) == problem
