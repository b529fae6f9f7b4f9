"""The batches: JOBS and RESULTS (broker and worker), REQUESTS and REPLIES (client and
broker, laid out alike): a table of the distinct tensor specs, one declared :class:`Row`
per job, result or failure, the tensor frames job by job. A row whose frames do not fit
its specs is refused alone; anything else wrong refuses the message."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeAlias, TypeVar

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
    Wire,
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
    Version,
    at_most,
    finite,
    finite_timing,
    hex_id,
    peek_hex,
)
from ipuserve.protocol.tensors import Frame, Specs, Tensors, checked_specs, received

_encode = msgspec.json.encode
#: A row's id: one hex id, or (REQUESTS and REPLIES) a group's ids.
Ids = HexId | tuple[HexId, ...]


class JobSpec(Header, frozen=True):
    """A JOBS or REQUESTS spec table entry: a model, its tensors' specs, and the version
    asked for (REQUESTS: None for the default) or placed on (JOBS)."""

    model: Name
    tensors: Specs
    version: Version | None = None


class JobRow(Row, frozen=True):
    job_id: HexId
    spec: Count
    budget_ms: Budget | None
    members: Members
    samples: Samples


class JobsHeader(Header, frozen=True):
    specs: tuple[JobSpec, ...]
    jobs: tuple[JobRow, ...]


class _Batch(Wire):
    """What every batch does with its two tuples of rows (``_ROWS`` names them): count
    them, halve them (:func:`split_batch`), send the first's tensors after a header."""

    __slots__ = ()
    _ROWS: ClassVar[tuple[str, str]]

    @property
    def rows(self) -> int:
        first, second = self._ROWS
        return len(getattr(self, first)) + len(getattr(self, second))

    def halves(self) -> tuple[Self, Self]:
        """The rows in two halves, the first tuple's rows first."""
        rows, others = (getattr(self, name) for name in self._ROWS)
        middle = (len(rows) + len(others)) // 2
        cut = max(0, middle - len(rows))
        first = type(self)(rows[:middle], others[:cut])  # type: ignore[call-arg]
        return first, type(self)(rows[middle:], others[cut:])  # type: ignore[call-arg]

    def _frames(self, header: Header) -> list[Frame]:
        items = getattr(self, self._ROWS[0])
        tensors = [frame for item in items for frame in item.tensors.frames]
        return frames(self.COMMAND, b"", _encode(header), tensors)


class _Outputs(_Batch):
    """RESULTS and REPLIES, laid out alike: outputs (tensors and timing) and failures.
    One encoder and one decoder for both; each class says how it writes a row of an
    output (``_row``) and makes an output of a good row (``_output``)."""

    __slots__ = ()
    _row: ClassVar[Callable[[Any, int], Row]]
    _output: ClassVar[Callable[..., Any]]

    def encode(self) -> list[Frame]:
        outputs, failures = (getattr(self, name) for name in self._ROWS)
        specs, at = _tabled(outputs, lambda output: output.tensors.specs)
        rows = tuple(type(self)._row(output, n) for output, n in at)
        return self._frames(self.HEADER(specs, rows, tuple(map(FailRow.of, failures))))

    @classmethod
    def from_wire(cls, _i: bytes, h: Any, tensors: Sequence[Frame], lim: Limits) -> Self:
        outputs, listed = getattr(h, cls._ROWS[0]), getattr(h, cls._ROWS[1])
        good, failed = _outputs(h.specs, outputs, listed, tensors, cls.COMMAND, lim)
        return cls(tuple(cls._output(*row) for row in good), failed)  # type: ignore[call-arg]


@dataclass(frozen=True, slots=True)
class Job:
    """A request forwarded to a worker; ``budget_ms`` is the time left before its deadline,
    ``samples`` the samples it carries, all members together (the broker counts them)."""

    job_id: bytes
    model: str
    tensors: Tensors
    budget_ms: float | None = None
    samples: int = 1
    #: the version the broker placed it on (a worker serves each name at one version)
    version: str | None = None


@dataclass(frozen=True, slots=True)
class Jobs(_Batch, command=Command.JOBS, header=JobsHeader, carries=Carries.BATCH):
    """Jobs for one worker, sent together. ``rejected`` is filled by :func:`decode`
    only: jobs whose tensor frames do not match their specs, as the FAIL to send."""

    _ROWS = ("jobs", "rejected")
    jobs: tuple[Job, ...]
    rejected: tuple[Fail, ...] = ()

    def encode(self) -> list[Frame]:
        keys, at = _tabled(self.jobs, lambda j: (j.model, j.tensors.specs, j.version))
        rows = tuple(
            JobRow(
                j.job_id.hex(), n, finite(j.budget_ms, "budget_ms"), j.tensors.members, j.samples
            )
            for j, n in at
        )
        return self._frames(JobsHeader(tuple(JobSpec(*key) for key in keys), rows))

    @classmethod
    def from_wire(cls, _i: bytes, h: JobsHeader, tensors: Sequence[Frame], lim: Limits) -> Jobs:
        good, bad = _unpack(h.specs, h.jobs, tensors, cls.COMMAND, lim)
        jobs = (
            Job(i, spec.model, t, row.budget_ms, row.samples, spec.version)
            for row, i, _g, spec, t in good
        )
        return cls(tuple(jobs), bad)


class RequestRow(Row, frozen=True):
    request_id: Ids
    spec: Count
    timeout_ms: Duration | None


class RequestsHeader(Header, frozen=True):
    specs: tuple[JobSpec, ...]
    requests: tuple[RequestRow, ...]


@dataclass(frozen=True, slots=True)
class Requests(_Batch, command=Command.REQUESTS, header=RequestsHeader, carries=Carries.BATCH):
    """Requests of one client, sent together: what its I/O thread had ready at once,
    laid out as JOBS. ``rejected`` is filled by :func:`decode` only: requests whose
    tensor frames do not match their specs, as the error to answer them with."""

    _ROWS = ("requests", "rejected")
    requests: tuple[Request, ...]
    rejected: tuple[Fail, ...] = ()

    def encode(self) -> list[Frame]:
        keys, at = _tabled(self.requests, lambda r: (r.model, r.tensors.specs, r.version))
        rows = tuple(RequestRow(_row_id(r), n, finite(r.timeout_ms, "timeout_ms")) for r, n in at)
        return self._frames(RequestsHeader(tuple(JobSpec(*key) for key in keys), rows))

    @classmethod
    def from_wire(
        cls, _i: bytes, h: RequestsHeader, tensors: Sequence[Frame], lim: Limits
    ) -> Requests:
        good, bad = _unpack(h.specs, h.requests, tensors, cls.COMMAND, lim)
        rows = (Request(i, s.model, t, row.timeout_ms, g, s.version) for row, i, g, s, t in good)
        return cls(tuple(rows), bad)


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

    def reply(
        self,
        request_id: bytes,
        group: tuple[bytes, ...],
        key: str,
        value: float,
        version: str | None = None,
    ) -> Reply:
        """The REPLY carrying this result to a client, its timing with ``key`` added
        (the broker's ``broker_queue_us``), saying which ``version`` answered."""
        timing = dict(self.timing)
        if key not in timing and len(timing) >= MAX_TIMING_KEYS:
            # With ``key`` the reply must stay within the limit, or the client refuses
            # it (a whole REPLIES): timing is only diagnostics, so the last entries go.
            timing = dict(itertools.islice(timing.items(), MAX_TIMING_KEYS - 1))
        timing[key] = value
        return Reply(request_id, self.tensors, timing, group, version)


@dataclass(frozen=True, slots=True)
class Results(_Outputs, command=Command.RESULTS, header=ResultsHeader, carries=Carries.BATCH):
    """Outcomes of jobs, sent together: results, and failures. :func:`decode` turns a
    result whose tensor frames do not match its specs into a failure (WORKER_FAILED:
    never the client's fault)."""

    _ROWS = ("results", "failures")
    _row = lambda r, n: ResultRow(r.job_id.hex(), n, finite_timing(r.timing), r.tensors.members)  # noqa: E731
    _output = lambda row, i, _g, _s, t: Result(i, t, row.timing)  # noqa: E731
    results: tuple[Result, ...] = ()
    failures: tuple[Fail, ...] = ()


class ReplyRow(Row, frozen=True):
    request_id: Ids
    spec: Count
    timing: Timing
    version: Version | None = None


class RepliesHeader(Header, frozen=True):
    specs: tuple[Specs, ...]
    replies: tuple[ReplyRow, ...]
    errors: tuple[FailRow, ...] = ()


@dataclass(frozen=True, slots=True)
class Replies(_Outputs, command=Command.REPLIES, header=RepliesHeader, carries=Carries.BATCH):
    """Replies to REQUESTS rows of one client, sent together: laid out as RESULTS, with
    ``replies`` and ``errors``. :func:`decode` turns a reply whose tensor frames do not
    match its specs into an error."""

    _ROWS = ("replies", "errors")
    _row = lambda r, n: ReplyRow(_row_id(r), n, finite_timing(r.timing), r.version)  # noqa: E731
    _output = lambda row, i, g, _s, t: Reply(i, t, row.timing, g, row.version)  # noqa: E731
    replies: tuple[Reply, ...] = ()
    errors: tuple[Fail, ...] = ()


#: This module's messages, for ipuserve.protocol.codec.
MESSAGES = (Jobs, Requests, Results, Replies)
Batch: TypeAlias = Jobs | Requests | Results | Replies
#: Each batch key's row fields, in order: how error messages name a row's entries.
_KEYS = ("jobs", "requests", "results", "replies", "failures", "errors")
_ROW_TYPES: tuple[type[Row], ...] = (JobRow, RequestRow, ResultRow, ReplyRow, FailRow, FailRow)
ROW_FIELDS = {key: row.__struct_fields__ for key, row in zip(_KEYS, _ROW_TYPES, strict=True)}


# ---------------------------------------------------------------- encoding


K = TypeVar("K", bound=Hashable)
Item = TypeVar("Item")


def _tabled(
    items: Sequence[Item], key: Callable[[Item], K]
) -> tuple[tuple[K, ...], list[tuple[Item, int]]]:
    """A batch's spec table (each distinct ``key`` once) and each item with its index."""
    table: dict[K, int] = {}
    indexed = [(item, table.setdefault(key(item), len(table))) for item in items]
    return tuple(table), indexed


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


# ---------------------------------------------------------------- decoding

R = TypeVar("R", JobRow, RequestRow, ResultRow, ReplyRow)
#: A good row: the row, its id, its group's ids, its spec table entry, its tensors.
Good = tuple[R, bytes, tuple[bytes, ...], Any, Tensors]


def _unpack(
    table: Sequence[Any], rows: tuple[R, ...], tensors: Sequence[Frame], cmd: Command, lim: Limits
) -> tuple[list[Good[R]], tuple[Fail, ...]]:
    """A batch's rows whose frames fit their specs, and a failure for each member of
    the others, the frames taken in order. A bad row id, spec index, member count or
    frame count refuses the whole message (its message built only then)."""
    key = _BATCH_KEYS[cmd]
    if len(rows) > lim.max_batch:
        at_most(len(rows), lim.max_batch, f"{cmd.name} header field {key!r}")
    specs = [entry.tensors if isinstance(entry, JobSpec) else entry for entry in table]
    field = "$.specs[{}].tensors" if cmd in (Command.JOBS, Command.REQUESTS) else "$.specs[{}]"
    for n, entry in enumerate(specs):
        checked_specs(entry, lim, cmd, field, n)
    listed = 0
    for n, row in enumerate(rows):
        if row.spec >= len(table):
            raise ProtocolError(
                f"{key}[{n}] names spec {row.spec}; the header lists {len(table)} spec(s)"
            )
        listed += len(specs[row.spec])
    if listed != len(tensors):
        raise ProtocolError(
            f"{cmd.name} header lists {listed} tensor(s) but {len(tensors)} tensor frame(s) follow"
        )
    good: list[Good[R]] = []
    bad: list[Fail] = []
    start = 0
    for n, row in enumerate(rows):
        ident, group = _ids(getattr(row, row.__struct_fields__[0]), cmd, n, lim)
        members = len(group) or getattr(row, "members", 1)
        if members > lim.max_batch:
            raise ProtocolError(
                f"{cmd.name} header field {key!r}: [{n}]: members must be an integer in "
                f"1..{lim.max_batch}; got {members}"
            )
        end = start + len(specs[row.spec])
        try:
            found = received(specs[row.spec], tensors[start:end], "", lim, members)
            good.append((row, ident, group, table[row.spec], found))
        except (InvalidInputError, PayloadTooLargeError) as exc:
            error: IpuserveError = exc
            if cmd is Command.RESULTS:  # the worker's outputs: never the client's fault
                error = WorkerFailedError(f"the worker sent outputs the protocol refuses: {exc}")
            bad += [Fail.of(member, error) for member in group or (ident,)]
        start = end
    return good, tuple(bad)


_BATCH_KEYS = {Command[key.upper()]: key for key in _KEYS[:4]}  # JOBS: jobs, ...


def _ids(value: Ids, cmd: Command, n: int, lim: Limits) -> tuple[bytes, tuple[bytes, ...]]:
    """Row ``n``'s id, or a group's ids (then the first is the row's id)."""
    if type(value) is str:
        found = peek_hex(value)
        if found is not None:
            return found, ()
    where = f"{cmd.name} header field {_BATCH_KEYS[cmd]!r}: [{n}]"
    if isinstance(value, str):
        return hex_id(value, where), ()
    at_most(len(value), lim.max_batch, where)
    if not value:
        raise ProtocolError(f"{where}: a group lists no ids")
    group = tuple(hex_id(item, f"{where}: [{n}]") for n, item in enumerate(value))
    if len(set(group)) != len(group):
        raise ProtocolError(f"{where}: a group lists an id twice")
    return group[0], group


def _outputs(
    table: Sequence[Specs],
    rows: tuple[R, ...],
    listed: tuple[FailRow, ...],
    tensors: Sequence[Frame],
    cmd: Command,
    lim: Limits,
) -> tuple[list[Good[R]], tuple[Fail, ...]]:
    """A RESULTS' or REPLIES' good rows, and its failures: those listed, then the rows
    whose frames do not fit their specs."""
    good, bad = _unpack(table, rows, tensors, cmd, lim)
    if not listed:
        return good, bad
    where = f"{cmd.name} header field {'failures' if cmd is Command.RESULTS else 'errors'!r}"
    at_most(len(listed), lim.max_batch, where)
    return good, tuple(row.fail(f"{where}: [{n}]") for n, row in enumerate(listed)) + bad
