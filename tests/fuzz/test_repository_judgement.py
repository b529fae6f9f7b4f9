"""The fuzzer's judgement of REPOSITORY answers (tests/fuzz/repository.py) bites.

A fuzz run that finds nothing proves something only if its checks can fail: these
feed the checks the answers a broken broker would give (a refusal an admin must not
get, a BAD_MESSAGE that names no field, a malformed command answered with a reply)
and the ones a correct broker gives, on frames the fuzzer itself builds.
"""

from __future__ import annotations

from ipuserve import protocol as wire
from ipuserve.protocol import Command
from tests.fuzz.engine import Report, decodes, frames_of
from tests.fuzz.repository import check_repository_answer, offending_field

RID = b"r0000001"


def judged(header: dict[str, object], answer: wire.Message) -> list[str]:
    frames = frames_of(Command.REPOSITORY, RID, header)
    message, _why = decodes(frames)
    report = Report("test", 0)
    check_repository_answer(frames, message, answer, report, "test")
    return [v.invariant for v in report.violations]


def test_an_admins_command_may_not_be_refused_permission_denied_and_index_never() -> None:
    load = {"action": "load", "model": "add", "version": "1"}
    assert judged(load, wire.ErrorReply(RID, "NO_ROOM", "no room")) == []
    assert judged(load, wire.RepositoryReply(RID, ())) == []
    assert judged(load, wire.ErrorReply(RID, "PERMISSION_DENIED", "no")) != []
    assert judged({"action": "index"}, wire.ErrorReply(RID, "UNKNOWN_MODEL", "x")) != []


def test_a_malformed_command_needs_bad_message_naming_its_field() -> None:
    bad = {"action": "load", "model": "add", "version": "01"}
    assert offending_field(decodes(frames_of(Command.REPOSITORY, RID, bad))[1]) == "version"
    named = wire.ErrorReply(RID, "BAD_MESSAGE", "REPOSITORY header: $.version is '01'")
    assert judged(bad, named) == []
    assert judged(bad, wire.ErrorReply(RID, "BAD_MESSAGE", "bad header")) != []
    assert judged(bad, wire.ErrorReply(RID, "UNKNOWN_MODEL", "version 01")) != []
    assert judged(bad, wire.RepositoryReply(RID, ())) != []
    missing = {"action": "unload"}
    assert judged(missing, wire.ErrorReply(RID, "BAD_MESSAGE", "unload needs a model")) == []


def test_the_index_may_not_list_a_version_twice() -> None:
    one = wire.VersionState("add", "1", "READY")
    assert judged({"action": "index"}, wire.RepositoryReply(RID, (one,))) == []
    assert judged({"action": "index"}, wire.RepositoryReply(RID, (one, one))) != []


def test_the_index_may_not_list_a_state_outside_the_four() -> None:
    gone = wire.VersionState("add", "1", "GONE")  # type: ignore[arg-type]
    assert judged({"action": "index"}, wire.RepositoryReply(RID, (gone,))) != []
