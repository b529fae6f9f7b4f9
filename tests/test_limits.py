"""ipuserve.limits states the wire's name, version and duration rules without the
wire; the protocol enforces the same ones at decode, and every component reads a
version with its one function, so none may drift apart."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ipuserve import limits
from ipuserve import protocol as wire
from ipuserve.client.repository import check_version
from ipuserve.errors import InvalidInputError, ProtocolError
from ipuserve.gateway.repository import versions_of_config
from ipuserve.versions import version_order


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


# ---------------------------------------------------------------- the one version syntax

VERSIONS_GOOD = ["1", "2", "10", "9" * 18]
#: "1\n": a `$` matched before the final newline; "\u0661" (Arabic-Indic one) and the
#: fullwidth "\uff11": str.isdigit() and int() take them (int("\u0661") == 1)
VERSIONS_BAD: list[Any] = ["", "0", "01", "1\n", "\n1", " 1", "1.0", "-1", "+1", "1e3"]
VERSIONS_BAD += ["\u0661", "\uff11", "1\u0661", "9" * 19, True, 1.0, None, ["1"]]


@pytest.mark.parametrize("version", VERSIONS_GOOD)
def test_a_version_is_read_alike_everywhere(version: str) -> None:
    assert limits.is_version(version) and limits.version_problem(version) is None
    header = {"model": "m", "tensors": [], "version": version}
    request = wire.decode([wire.envelope(wire.Command.REQUEST, b"r"), json.dumps(header).encode()])
    assert isinstance(request, wire.Request) and request.version == version
    assert check_version(version) == version
    assert version_order(version) == (int(version), version)


@pytest.mark.parametrize("version", VERSIONS_BAD, ids=repr)
def test_what_is_no_version_is_refused_everywhere(version: Any) -> None:
    """The wire, the client's check, the broker's order and the gateway's version
    policy all use ipuserve.limits' one syntax."""
    assert not limits.is_version(version)
    assert limits.version_problem(version) == (f"must be {limits.VERSION_RULE}, not {version!r}")
    if isinstance(version, str):
        header = {"model": "m", "tensors": [], "version": version}
        with pytest.raises(ProtocolError, match=r"\$\.version"):
            wire.decode([wire.envelope(wire.Command.REQUEST, b"r"), json.dumps(header).encode()])
        assert version_order(version)[0] == -1
    if version is not None:  # the client's None: the model's default
        with pytest.raises(InvalidInputError, match="a version must be a whole number"):
            check_version(version)
    # (the client and the gateway take an int as its digits: 2 is "2")
    policy = {"version_policy": {"specific": {"versions": [version]}}}
    with pytest.raises(InvalidInputError, match="a version in version_policy must be"):
        versions_of_config(json.dumps(policy), ["1"])
