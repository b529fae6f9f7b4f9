"""The batches: JOBS (broker -> worker) and RESULTS (worker -> broker), and REQUESTS
(client -> broker) and REPLIES (broker -> client), laid out as JOBS and RESULTS.

A batch's header holds a table of the distinct tensor specs (with the model, for
JOBS and REQUESTS) and one row per job, result or failure (a JSON array, declared as
a :class:`Row`); the tensor frames follow job by job. A row whose frames do not
match its specs is refused alone (the others go on); anything else wrong refuses
the message.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgspec

from ipuserve.errors import (
    InvalidInputError,
    IpuserveError,
    PayloadTooLargeError,
    ProtocolError,
    WorkerFailedError,
)
from ipuserve.protocol.client_messages import Reply, Request
from ipuserve.protocol.envelope import (
    DEFAULT_LIMITS,
    MAX_TIMING_KEYS,
    Carries,
    Command,
    Limits,
    frames,
    nbytes,
)
from ipuserve.protocol.failures import Fail, FailRow
from ipuserve.protocol.fields import (
    Budget,
    Count,
    Duration,
    Header,
    HexId,
    Members,
    Name,
    Row,
    Samples,
    Timing,
    at_most,
    hex_id,
)
from ipuserve.protocol.tensors import Frame, Tensors, TensorSpec, checked_specs, received

_encode = msgspec.json.encode
Specs = tuple[TensorSpec, ...]
#: A row's id: one hex id, or (REQUESTS and REPLIES) a group's ids.
Ids = HexId | tuple[HexId, ...]


class JobSpec(Header, frozen=True):
    """A JOBS or REQUESTS spec table entry: a model and its tensors' specs."""

    model: Name
    tensors: Specs


class JobRow(Row, frozen=True):
    job_id: HexId
    spec: Count
    budget_ms: Budget | None
    members: Members
    samples: Samples


class JobsHeader(Header, frozen=True):
    specs: tuple[JobSpec, ...]
    jobs: tuple[JobRow, ...]


@dataclass(frozen=True, slots=True)
class Job:
    """A request forwarded to a worker; ``budget_ms`` is the time left before its deadline,
    ``samples`` the samples it carries, all members together (the broker counts them)."""

    job_id: bytes
    model: str
    tensors: Tensors
    budget_ms: float | None = None
    samples: int = 1


@dataclass(frozen=True, slots=True)
class Jobs:
    """Jobs for one worker, sent together: rows ``[id hex, spec index, budget_ms or null,
    members, samples]``. ``rejected`` is filled by :func:`decode` only: jobs whose
    tensor frames do not match their specs, as the FAIL their sender should get."""

    COMMAND: ClassVar[Command] = Command.JOBS
    HEADER: ClassVar[type[Header]] = JobsHeader
    CARRIES: ClassVar[Carries] = Carries.BATCH
    jobs: tuple[Job, ...]
    rejected: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.jobs)

    def halves(self) -> tuple[Jobs, Jobs]:
        middle = len(self.jobs) // 2
        return Jobs(self.jobs[:middle]), Jobs(self.jobs[middle:])

    def encode(self) -> list[Frame]:
        table: dict[tuple[str, Specs], int] = {}
        rows = [
            JobRow(
                j.job_id.hex(),
                _index(table, (j.model, j.tensors.specs)),
                j.budget_ms,
                j.tensors.members,
                j.samples,
            )
            for j in self.jobs
        ]
        header = JobsHeader(tuple(JobSpec(*key) for key in table), tuple(rows))
        return frames(self.COMMAND, b"", _encode(header), _frames_of(self.jobs))

    @classmethod
    def from_wire(cls, _i: bytes, h: JobsHeader, tensors: Sequence[Frame], lim: Limits) -> Jobs:
        jobs, rejected = [], []
        for row, ident, _group, spec, found in _unpack(h.specs, h.jobs, tensors, "jobs", lim):
            if isinstance(found, Tensors):
                jobs.append(Job(ident, spec.model, found, row.budget_ms, row.samples))
            else:
                rejected.append(Fail.of(ident, found))
        return cls(tuple(jobs), tuple(rejected))


class RequestRow(Row, frozen=True):
    request_id: Ids
    spec: Count
    timeout_ms: Duration | None


class RequestsHeader(Header, frozen=True):
    specs: tuple[JobSpec, ...]
    requests: tuple[RequestRow, ...]


@dataclass(frozen=True, slots=True)
class Requests:
    """Requests of one client, sent together: what its I/O thread had ready at once.
    Laid out as JOBS, rows ``[request id hex or [ids of a group], spec index,
    timeout_ms or null]``. ``rejected`` is filled by :func:`decode` only: requests
    whose tensor frames do not match their specs, as the error to answer them with."""

    COMMAND: ClassVar[Command] = Command.REQUESTS
    HEADER: ClassVar[type[Header]] = RequestsHeader
    CARRIES: ClassVar[Carries] = Carries.BATCH
    requests: tuple[Request, ...]
    rejected: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.requests)

    def halves(self) -> tuple[Requests, Requests]:
        middle = len(self.requests) // 2
        return Requests(self.requests[:middle]), Requests(self.requests[middle:])

    def encode(self) -> list[Frame]:
        table: dict[tuple[str, Specs], int] = {}
        rows = [
            RequestRow(_row_id(r), _index(table, (r.model, r.tensors.specs)), r.timeout_ms)
            for r in self.requests
        ]
        header = RequestsHeader(tuple(JobSpec(*key) for key in table), tuple(rows))
        return frames(self.COMMAND, b"", _encode(header), _frames_of(self.requests))

    @classmethod
    def from_wire(
        cls, _i: bytes, h: RequestsHeader, tensors: Sequence[Frame], lim: Limits
    ) -> Requests:
        requests, rejected = [], []
        for row, ident, group, spec, found in _unpack(
            h.specs, h.requests, tensors, "requests", lim
        ):
            if isinstance(found, Tensors):
                requests.append(Request(ident, spec.model, found, row.timeout_ms, group))
            else:
                rejected += [Fail.of(member, found) for member in group or (ident,)]
        return cls(tuple(requests), tuple(rejected))


class ResultRow(Row, frozen=True):
    job_id: HexId
    spec: Count
    timing: Timing
    members: Members = 1


class ResultsHeader(Header, frozen=True):
    specs: tuple[Specs, ...]
    results: tuple[ResultRow, ...]
    failures: tuple[FailRow, ...] = ()


@dataclass(frozen=True, slots=True)
class Result:
    job_id: bytes
    tensors: Tensors
    timing: Mapping[str, float]

    def reply(self, request_id: bytes, group: tuple[bytes, ...], key: str, value: float) -> Reply:
        """The REPLY carrying this result to a client, its timing with ``key`` added
        (the broker's ``broker_queue_us``)."""
        timing = dict(self.timing)
        if key not in timing and len(timing) >= MAX_TIMING_KEYS:
            # A worker may send MAX_TIMING_KEYS entries, but the reply must stay within
            # that limit with ``key`` added, or the client refuses it as malformed (and
            # with it a whole REPLIES batch). The outputs are right, and timing is only
            # diagnostics: the worker's surplus entries (the last ones) are dropped
            # rather than failing a correct result.
            timing = dict(itertools.islice(timing.items(), MAX_TIMING_KEYS - 1))
        timing[key] = value
        return Reply(request_id, self.tensors, timing, group)


@dataclass(frozen=True, slots=True)
class Results:
    """Outcomes of jobs, sent together: results (rows ``[id hex, spec index, timing,
    members]``), and failures (``[id hex, code, message]``, which may be left out).
    :func:`decode` turns a result whose tensor frames do not match its specs into a
    failure with the error found."""

    COMMAND: ClassVar[Command] = Command.RESULTS
    HEADER: ClassVar[type[Header]] = ResultsHeader
    CARRIES: ClassVar[Carries] = Carries.BATCH
    results: tuple[Result, ...] = ()
    failures: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.results) + len(self.failures)

    def halves(self) -> tuple[Results, Results]:
        first, second = _halve(self.results, self.failures)
        return Results(*first), Results(*second)

    def encode(self) -> list[Frame]:
        table: dict[Specs, int] = {}
        rows = [
            ResultRow(
                r.job_id.hex(), _index(table, r.tensors.specs), dict(r.timing), r.tensors.members
            )
            for r in self.results
        ]
        failures = tuple(map(FailRow.of, self.failures))
        header = ResultsHeader(tuple(table), tuple(rows), failures)
        return frames(self.COMMAND, b"", _encode(header), _frames_of(self.results))

    @classmethod
    def from_wire(
        cls, _i: bytes, h: ResultsHeader, tensors: Sequence[Frame], lim: Limits
    ) -> Results:
        results, failures = [], _failures(h.failures, "failures", lim)
        for row, ident, _g, _s, found in _unpack(h.specs, h.results, tensors, "results", lim):
            if isinstance(found, Tensors):
                results.append(Result(ident, found, row.timing))
            else:  # the worker's outputs: never the client's fault
                why = f"the worker sent outputs the protocol refuses: {found}"
                failures.append(Fail.of(ident, WorkerFailedError(why)))
        return cls(tuple(results), tuple(failures))


class ReplyRow(Row, frozen=True):
    request_id: Ids
    spec: Count
    timing: Timing


class RepliesHeader(Header, frozen=True):
    specs: tuple[Specs, ...]
    replies: tuple[ReplyRow, ...]
    errors: tuple[FailRow, ...] = ()


@dataclass(frozen=True, slots=True)
class Replies:
    """Replies to REQUESTS rows of one client, sent together: laid out as RESULTS, rows
    ``[request id hex or [ids of a group], spec index, timing]`` under ``"replies"``
    and failures under ``"errors"``. :func:`decode` turns a reply whose tensor frames
    do not match its specs into an error."""

    COMMAND: ClassVar[Command] = Command.REPLIES
    HEADER: ClassVar[type[Header]] = RepliesHeader
    CARRIES: ClassVar[Carries] = Carries.BATCH
    replies: tuple[Reply, ...] = ()
    errors: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.replies) + len(self.errors)

    def halves(self) -> tuple[Replies, Replies]:
        first, second = _halve(self.replies, self.errors)
        return Replies(*first), Replies(*second)

    def encode(self) -> list[Frame]:
        table: dict[Specs, int] = {}
        rows = [
            ReplyRow(_row_id(r), _index(table, r.tensors.specs), dict(r.timing))
            for r in self.replies
        ]
        header = RepliesHeader(tuple(table), tuple(rows), tuple(map(FailRow.of, self.errors)))
        return frames(self.COMMAND, b"", _encode(header), _frames_of(self.replies))

    @classmethod
    def from_wire(
        cls, _i: bytes, h: RepliesHeader, tensors: Sequence[Frame], lim: Limits
    ) -> Replies:
        replies, errors = [], _failures(h.errors, "errors", lim)
        for row, ident, group, _s, found in _unpack(h.specs, h.replies, tensors, "replies", lim):
            if isinstance(found, Tensors):
                replies.append(Reply(ident, found, row.timing, group))
            else:
                errors += [Fail.of(member, found) for member in group or (ident,)]
        return cls(tuple(replies), tuple(errors))


#: This module's messages, for ipuserve.protocol.codec.
MESSAGES = (Jobs, Requests, Results, Replies)
#: Each batch key's row fields, in order: how error messages name a row's entries.
ROW_FIELDS = {
    key: row.__struct_fields__
    for key, row in (
        ("jobs", JobRow),
        ("requests", RequestRow),
        ("results", ResultRow),
        ("replies", ReplyRow),
        ("failures", FailRow),
        ("errors", FailRow),
    )
}


# ---------------------------------------------------------------- encoding

K = TypeVar("K", bound=Hashable)


def _index(table: dict[K, int], key: K) -> int:
    """``key``'s entry in a batch's spec table, added if new."""
    found = table.get(key)
    if found is None:
        found = table[key] = len(table)
    return found


def _frames_of(items: Sequence[Job | Request | Result | Reply]) -> list[Frame]:
    return [frame for item in items for frame in item.tensors.frames]


def _row_id(item: Request | Reply) -> Ids:
    """A REQUESTS or REPLIES row's id: one hex id, or a group's (one per member)."""
    if not item.group:
        return item.request_id.hex()
    if item.tensors.members != len(item.group):
        raise ValueError(f"a group of {len(item.group)} ids carries {item.tensors.members} members")
    return tuple(member.hex() for member in item.group)


B = TypeVar("B", Jobs, Requests, Results, Replies)


def encode_batch(message: B, limits: Limits = DEFAULT_LIMITS) -> list[list[Frame]]:
    """A batch's frames, as several messages where one would break the receiver's limits
    (``max_batch`` rows, ``max_header_bytes``): halved until each part fits."""
    return [frames for _part, frames in split_batch(message, limits)]


def split_batch(message: B, limits: Limits = DEFAULT_LIMITS) -> list[tuple[B, list[Frame]]]:
    """:func:`encode_batch`, with the part of the batch each message carries."""
    rows = message.rows
    if rows <= limits.max_batch:
        encoded = message.encode()
        if rows <= 1 or nbytes(encoded[1]) <= limits.max_header_bytes:
            return [(message, encoded)]
    first, second = message.halves()
    return split_batch(first, limits) + split_batch(second, limits)


T = TypeVar("T")


def _halve(
    outputs: tuple[T, ...], failures: tuple[Fail, ...]
) -> tuple[tuple[tuple[T, ...], tuple[Fail, ...]], tuple[tuple[T, ...], tuple[Fail, ...]]]:
    """Split the rows of a RESULTS or REPLIES in two halves, outputs first."""
    middle = (len(outputs) + len(failures)) // 2
    if middle <= len(outputs):
        return (outputs[:middle], ()), (outputs[middle:], failures)
    cut = middle - len(outputs)
    return (outputs, failures[:cut]), ((), failures[cut:])


# ---------------------------------------------------------------- decoding

Found = Tensors | IpuserveError
R = TypeVar("R", JobRow, RequestRow, ResultRow, ReplyRow)


def _unpack(
    table: Sequence[Any], rows: tuple[R, ...], tensors: Sequence[Frame], key: str, limits: Limits
) -> list[tuple[R, bytes, tuple[bytes, ...], Any, Found]]:
    """Each row with its id, its group's ids, its spec table entry and its tensors (or
    why its frames do not fit it), the frames taken in order; a bad row id, spec index
    or frame count refuses the whole message."""
    where = f"{tables_name(key)} header field {key!r}"
    at_most(len(rows), limits.max_batch, where)
    specs = [_specs_of(entry) for entry in table]
    for n, entry in enumerate(specs):
        checked_specs(entry, limits, f"{tables_name(key)} header field 'specs': [{n}]")
    unpacked = []
    start = 0
    for n, row in enumerate(rows):
        ident, group = _ids(getattr(row, row.__struct_fields__[0]), f"{where}: [{n}]", limits)
        if row.spec >= len(table):
            raise ProtocolError(
                f"{key}[{n}] names spec {row.spec}; the header lists {len(table)} spec(s)"
            )
        members = len(group) or getattr(row, "members", 1)
        if members > limits.max_batch:
            raise ProtocolError(
                f"{where}: [{n}]: members must be an integer in 1..{limits.max_batch}; "
                f"got {members}"
            )
        end = start + len(specs[row.spec])
        unpacked.append((row, ident, group, table[row.spec], (start, end, members)))
        start = end
    if start != len(tensors):
        raise ProtocolError(
            f"{tables_name(key)} header lists {start} tensor(s) but "
            f"{len(tensors)} tensor frame(s) follow"
        )
    return [
        (row, ident, group, entry, _received(_specs_of(entry), tensors, span, limits))
        for row, ident, group, entry, span in unpacked
    ]


def _received(
    specs: Specs, tensors: Sequence[Frame], span: tuple[int, int, int], limits: Limits
) -> Found:
    start, end, members = span
    try:
        return received(specs, tensors[start:end], "", limits, members)
    except (InvalidInputError, PayloadTooLargeError) as exc:
        return exc


def _specs_of(entry: JobSpec | Specs) -> Specs:
    return entry.tensors if isinstance(entry, JobSpec) else entry


_COMMANDS = {"jobs": "JOBS", "requests": "REQUESTS", "results": "RESULTS", "replies": "REPLIES"}
tables_name: Callable[[str], str] = _COMMANDS.__getitem__


def _ids(value: Ids, where: str, limits: Limits) -> tuple[bytes, tuple[bytes, ...]]:
    """A row's id, or a group's ids (then the first is the row's id)."""
    if isinstance(value, str):
        return hex_id(value, where), ()
    at_most(len(value), limits.max_batch, where)
    if not value:
        raise ProtocolError(f"{where}: a group lists no ids")
    group = tuple(hex_id(item, f"{where}: [{n}]") for n, item in enumerate(value))
    if len(set(group)) != len(group):
        raise ProtocolError(f"{where}: a group lists an id twice")
    return group[0], group


def _failures(rows: tuple[FailRow, ...], key: str, limits: Limits) -> list[Fail]:
    where = f"{'RESULTS' if key == 'failures' else 'REPLIES'} header field {key!r}"
    at_most(len(rows), limits.max_batch, where)
    return [row.fail(f"{where}: [{n}]") for n, row in enumerate(rows)]
