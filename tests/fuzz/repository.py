"""The fuzzer's REPOSITORY commands and version fields, and what their answers must be.

Protocol version 5's control messages (ipuserve/protocol/control.py): an admin's
REPOSITORY (``index``, ``load``, ``unload``) is answered with a REPOSITORY_REPLY or an
ERROR saying why not. The fuzzer's peers are on loopback, which a broker in protected
mode treats as admin, so PERMISSION_DENIED is never an allowed answer here. The
invariants checked on every answer:

* a well-formed REPOSITORY gets a REPOSITORY_REPLY or an ERROR with a code of
  :data:`REPOSITORY_CODES`; an ``index`` is never refused;
* a malformed one (its envelope and JSON header intact) gets BAD_MESSAGE naming the
  field the decoder objects to;
* the index never lists a version in a state outside :data:`STATES`.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, get_args

from ipuserve import protocol as wire
from ipuserve.protocol import Command
from ipuserve.protocol.control import State
from tests.fuzz.engine import Report, decodes, frames_of, random_json

STATES = frozenset(get_args(State))
#: What a REPOSITORY from an admin may be refused with.
REPOSITORY_CODES = frozenset({"BAD_MESSAGE", "UNKNOWN_MODEL", "NO_ROOM", "PAYLOAD_TOO_LARGE"})
#: Versions a request or command may name: "1" exists (the ``add`` worker's, and the
#: fake hosts' repositories), the others are unknown or malformed.
VERSIONS = ["1", "1", "2", "3", "99", "123456789012345678"]
BAD_VERSIONS = ["0", "01", "v1", "", "-1", "1" * 19, "1.0", "x" * 300, 1, None, [1]]
MODELS = ["add", "add", "fz", "mlp", "nope", "", "x" * 257, "x" * 256]
ACTIONS = ["index", "load", "unload"]


def version_field(rng: random.Random) -> Any:
    """A request's or command's ``version``: existing, unknown or malformed."""
    return rng.choice(VERSIONS) if rng.random() < 0.6 else rng.choice(BAD_VERSIONS)


def repository_header(rng: random.Random) -> dict[str, Any]:
    """A REPOSITORY header: every action, known and unknown models and versions, and
    some malformed on purpose (bad version strings, missing model, oversized fields)."""
    header: dict[str, Any] = {"action": rng.choice(ACTIONS)}
    if rng.random() < 0.85:  # a load or unload without one is malformed
        header["model"] = rng.choice(MODELS)
    if rng.random() < 0.5:
        header["version"] = version_field(rng)
    for key in ("replicas", "workers"):
        if rng.random() < 0.15:
            header[key] = rng.choice([1, 1, 2, 0, -1, 2**40, "2", 1.5])
    if rng.random() < 0.05:
        header["action"] = rng.choice(["reload", "", "INDEX", 1, None])
    if rng.random() < 0.03:
        header[rng.choice(["extra", "Model", "x" * 300])] = random_json(rng)
    return header


def repository_message(rng: random.Random, rid: bytes) -> list[bytes]:
    return frames_of(Command.REPOSITORY, rid, repository_header(rng))


def offending_field(why: str) -> str | None:
    """The header field a decoder error names, if it names one."""
    if "needs a model" in why:
        return "model"
    found = re.search(r"\$\.(\w+)", why) or re.search(r"unknown field `([^`]+)`", why)
    return found.group(1) if found else None


def check_repository_answer(
    frames: list[bytes], message: wire.Message | None, answer: Any, report: Report, what: str
) -> None:
    """Check the answer (a RepositoryReply, an ErrorReply, or anything else the broker
    sent with this message's id) to a REPOSITORY, well-formed or not."""
    if isinstance(answer, wire.RepositoryReply):
        check_index(answer, report, what)
    if isinstance(message, wire.RepositoryCommand):
        if isinstance(answer, wire.ErrorReply):
            if answer.code not in REPOSITORY_CODES or message.action == "index":
                report.violate(
                    "an admin's REPOSITORY is answered with a reply or an allowed code",
                    f"{what}: {message.action} {message.model!r} {message.version!r} "
                    f"refused {answer.code}: {answer.message}",
                )
        elif not isinstance(answer, wire.RepositoryReply):
            report.violate(
                "an admin's REPOSITORY is answered with a reply or an allowed code",
                f"{what}: answered with {type(answer).__name__}",
            )
        return
    intact = (
        message is None
        and len(frames) == 2
        and frames[0].startswith(wire.envelope(Command.REPOSITORY))
        and len(frames[0]) <= 6 + 64
        and len(frames[1]) <= wire.DEFAULT_LIMITS.max_header_bytes
    )
    if not intact:
        return
    try:
        header = json.loads(frames[1])
    except (ValueError, RecursionError):
        return
    if not isinstance(header, dict):
        return
    _message, why = decodes(frames)
    field = offending_field(why)
    if not isinstance(answer, wire.ErrorReply) or answer.code != "BAD_MESSAGE":
        report.violate(
            "a malformed REPOSITORY gets BAD_MESSAGE",
            f"{what}: {why}; answered {getattr(answer, 'code', type(answer).__name__)}",
        )
    elif field is not None and field not in answer.message:
        report.violate(
            "a malformed REPOSITORY's BAD_MESSAGE names the field",
            f"{what}: {why}; the broker said {answer.message!r}",
        )


def check_index(reply: wire.RepositoryReply, report: Report, what: str) -> None:
    """The index lists every version in one of the four states, each (name, version)
    once."""
    seen: set[tuple[str, str]] = set()
    for entry in reply.models:
        key = (entry.name, entry.version)
        if entry.state not in STATES:
            report.violate("the index lists only known states", f"{what}: {entry}")
        if key in seen:
            report.violate("the index lists a version once", f"{what}: {key}")
        seen.add(key)
