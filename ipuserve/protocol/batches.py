"""The batches: JOBS (broker -> worker) and RESULTS (worker -> broker), and REQUESTS
(client -> broker) and REPLIES (broker -> client), laid out as JOBS and RESULTS.

A batch's header holds a table of the distinct tensor specs (with the model, for
JOBS and REQUESTS) and one row per job, result or failure; the tensor frames follow
job by job. Each batch's decoder sits right below it; the checks of single rows are
in :mod:`ipuserve.protocol.rows`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias, TypeVar

from ipuserve.errors import ProtocolError, WorkerFailedError
from ipuserve.protocol.checks import (
    _BATCH,
    _TENSORS,
    T,
    _as_object,
    _batch_tensors,
    _check_fields,
    _Decoder,
    _Field,
    _memo,
    _name,
    _nbytes,
    _rows,
    _tensor_specs,
)
from ipuserve.protocol.client_messages import Reply, Request
from ipuserve.protocol.envelope import (
    DEFAULT_LIMITS,
    MAX_TIMING_KEYS,
    Command,
    Limits,
    _frames,
    _json,
    _number,
    _specs_json,
)
from ipuserve.protocol.failures import Fail, _failure_row
from ipuserve.protocol.one_row import one_job, one_result
from ipuserve.protocol.rows import Row, _job_rows, _reply_rows, _request_rows, _result_rows
from ipuserve.protocol.tensors import Frame, Tensors, TensorSpec


@dataclass(frozen=True, slots=True)
class Job:
    """A request forwarded to a worker; ``budget_ms`` is the time left before its deadline."""

    job_id: bytes
    model: str
    tensors: Tensors
    budget_ms: float | None = None


def _job_spec(value: Any, limits: Limits) -> tuple[str, tuple[TensorSpec, ...]]:
    fields = _check_fields(_as_object(value), _JOB_SPEC_SCHEMA, "spec", limits)
    return fields["model"], fields["tensors"]


_JOB_SPEC_SCHEMA = {"model": _Field(_name), "tensors": _TENSORS}


@dataclass(frozen=True, slots=True)
class Result:
    job_id: bytes
    tensors: Tensors
    timing: Mapping[str, float]
    #: ``timing`` as the JSON text it was received in, when the fast path read it
    #: (ipuserve.protocol.fastpath): :meth:`reply` passes it on without re-formatting
    timing_json: str | None = field(default=None, compare=False, repr=False)

    def reply(self, request_id: bytes, group: tuple[bytes, ...], key: str, value: float) -> Reply:
        """The REPLY carrying this result to a client, its timing with ``key`` added
        (the broker's ``broker_queue_us``): the received timing text is passed on with
        the entry appended, where encoding the dict would give the same JSON object."""
        timing = dict(self.timing)
        text = self.timing_json
        if key not in timing and len(timing) >= MAX_TIMING_KEYS:
            # A worker may send MAX_TIMING_KEYS entries, but the reply must stay within
            # that limit with ``key`` added, or the client refuses it as malformed (and
            # with it a whole REPLIES batch). The outputs are right, and timing is only
            # diagnostics: the worker's surplus entries (the last ones) are dropped
            # rather than failing a correct result.
            timing = dict(itertools.islice(timing.items(), MAX_TIMING_KEYS - 1))
            text = None
        if text is not None and (
            key in timing or type(value) is not float or value - value != 0 or '"' in key
        ):
            text = None  # a replaced entry, or a value JSON cannot hold: encode it all
        timing[key] = value
        if text is not None:
            text = f'{text[:-1]}{"," if len(text) > 2 else ""}"{key}":{float(value)!r}}}'
        return Reply(request_id, self.tensors, timing, group, text)


@dataclass(frozen=True, slots=True)
class Jobs:
    """Jobs for one worker, sent together.

    Header ``{"specs": [{"model", "tensors"}...], "jobs": [[id hex, spec index,
    budget_ms or null]...]}``: jobs with the same model and tensor specs share one
    entry of ``specs``, so the header stays small and the receiver checks each
    distinct spec once. ``rejected`` is filled by :func:`decode` only: jobs whose
    tensor frames do not match their specs, as the FAIL their sender should get.
    """

    COMMAND: ClassVar[Command] = Command.JOBS
    jobs: tuple[Job, ...]
    rejected: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.jobs)

    def halves(self) -> tuple[Jobs, Jobs]:
        middle = len(self.jobs) // 2
        return Jobs(self.jobs[:middle]), Jobs(self.jobs[middle:])

    def encode(self) -> list[Frame]:
        if len(self.jobs) == 1:  # the usual JOBS at low load: the same text, fewer calls
            job = self.jobs[0]
            return one_job(job.job_id, job.model, job.tensors, job.budget_ms)
        rows = ((j.job_id, j.model, j.tensors, j.budget_ms, ()) for j in self.jobs)
        return _encode_inputs(self.COMMAND, "jobs", rows)


def _build_jobs(_i: bytes, fields: dict[str, Any], frames: Sequence[Frame], lim: Limits) -> Jobs:
    good, rejected = _inputs(fields, frames, "jobs", Command.JOBS, lim)
    return Jobs(tuple(Job(*row[:4]) for row in good), rejected)


_JOBS = _Decoder(
    Command.JOBS,
    {"specs": _Field(_memo(_rows(_job_spec))), "jobs": _Field(_job_rows)},
    _build_jobs,
    tensors=_BATCH,
)


@dataclass(frozen=True, slots=True)
class Requests:
    """Requests of one client, sent together: what its I/O thread had ready at once.

    Laid out as JOBS, rows ``[request id hex, spec index, timeout_ms or null]``
    under ``"requests"``. ``rejected`` is filled by :func:`decode` only: requests
    whose tensor frames do not match their specs, as the error to answer them with.
    """

    COMMAND: ClassVar[Command] = Command.REQUESTS
    requests: tuple[Request, ...]
    rejected: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.requests)

    def halves(self) -> tuple[Requests, Requests]:
        middle = len(self.requests) // 2
        return Requests(self.requests[:middle]), Requests(self.requests[middle:])

    def encode(self) -> list[Frame]:
        rows = ((r.request_id, r.model, r.tensors, r.timeout_ms, r.group) for r in self.requests)
        return _encode_inputs(self.COMMAND, "requests", rows)


def _build_requests(
    _i: bytes, fields: dict[str, Any], frames: Sequence[Frame], lim: Limits
) -> Requests:
    good, rejected = _inputs(fields, frames, "requests", Command.REQUESTS, lim)
    return Requests(tuple(Request(*row) for row in good), rejected)


_REQUESTS = _Decoder(
    Command.REQUESTS,
    {"specs": _Field(_memo(_rows(_job_spec))), "requests": _Field(_request_rows)},
    _build_requests,
    tensors=_BATCH,
)


@dataclass(frozen=True, slots=True)
class Results:
    """Outcomes of jobs, sent together: results, and failures (a code and message each).

    Header ``{"specs": [[tensor spec...]...], "results": [[id hex, spec index,
    timing]...], "failures": [[id hex, code, message]...]}`` (``failures`` may be
    left out). :func:`decode` turns a result whose tensor frames do not match its
    specs into a failure with the error found.
    """

    COMMAND: ClassVar[Command] = Command.RESULTS
    results: tuple[Result, ...] = ()
    failures: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.results) + len(self.failures)

    def halves(self) -> tuple[Results, Results]:
        first, second = _halve(self.results, self.failures)
        return Results(*first), Results(*second)

    def encode(self) -> list[Frame]:
        if len(self.results) == 1 and not self.failures:  # the usual one: fewer calls
            result = self.results[0]
            return one_result(result.job_id, result.tensors, result.timing, result.timing_json)
        rows = ((r.job_id, r.tensors, r.timing_json or r.timing, ()) for r in self.results)
        return _encode_outputs(self.COMMAND, ("results", "failures"), rows, self.failures)


def _build_results(
    _i: bytes, fields: dict[str, Any], frames: Sequence[Frame], lim: Limits
) -> Results:
    good, failures = _outputs(fields, frames, ("results", "failures"), Command.RESULTS, lim)
    return Results(tuple(Result(*row[:3]) for row in good), failures)


_RESULTS = _Decoder(
    Command.RESULTS,
    {
        "specs": _Field(_memo(_rows(_tensor_specs))),
        "results": _Field(_result_rows),
        "failures": _Field(_rows(_failure_row), required=False),
    },
    _build_results,
    tensors=_BATCH,
)


@dataclass(frozen=True, slots=True)
class Replies:
    """Replies to REQUESTS rows of one client, sent together: results, and errors.

    Laid out as RESULTS, rows ``[request id hex, spec index, timing]`` under
    ``"replies"`` and ``[request id hex, code, message]`` under ``"errors"``
    (which may be left out). :func:`decode` turns a reply whose tensor frames do
    not match its specs into an error.
    """

    COMMAND: ClassVar[Command] = Command.REPLIES
    replies: tuple[Reply, ...] = ()
    errors: tuple[Fail, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.replies) + len(self.errors)

    def halves(self) -> tuple[Replies, Replies]:
        first, second = _halve(self.replies, self.errors)
        return Replies(*first), Replies(*second)

    def encode(self) -> list[Frame]:
        rows = ((r.request_id, r.tensors, r.timing_json or r.timing, r.group) for r in self.replies)
        return _encode_outputs(self.COMMAND, ("replies", "errors"), rows, self.errors)


def _build_replies(
    _i: bytes, fields: dict[str, Any], frames: Sequence[Frame], lim: Limits
) -> Replies:
    good, errors = _outputs(fields, frames, ("replies", "errors"), Command.REPLIES, lim)
    return Replies(tuple(Reply(*row) for row in good), errors)


_REPLIES = _Decoder(
    Command.REPLIES,
    {
        "specs": _Field(_memo(_rows(_tensor_specs))),
        "replies": _Field(_reply_rows),
        "errors": _Field(_rows(_failure_row), required=False),
    },
    _build_replies,
    tensors=_BATCH,
)

#: This module's decoders, for ipuserve.protocol.codec.
_DECODERS = (_JOBS, _REQUESTS, _RESULTS, _REPLIES)


# ---------------------------------------------------------------- encoding


B = TypeVar("B", "Jobs", "Requests", "Results", "Replies")


def encode_batch(message: B, limits: Limits = DEFAULT_LIMITS) -> list[list[Frame]]:
    """A batch's frames, as several messages where one would break the receiver's limits
    (``max_batch`` rows, ``max_header_bytes``): halved until each part fits."""
    return [frames for _part, frames in split_batch(message, limits)]


def split_batch(message: B, limits: Limits = DEFAULT_LIMITS) -> list[tuple[B, list[Frame]]]:
    """:func:`encode_batch`, with the part of the batch each message carries."""
    rows = message.rows
    if rows <= limits.max_batch:
        frames = message.encode()
        if rows <= 1 or _nbytes(frames[1]) <= limits.max_header_bytes:
            return [(message, frames)]
    first, second = message.halves()
    return split_batch(first, limits) + split_batch(second, limits)


def _halve(
    outputs: tuple[T, ...], failures: tuple[Fail, ...]
) -> tuple[tuple[tuple[T, ...], tuple[Fail, ...]], tuple[tuple[T, ...], tuple[Fail, ...]]]:
    """Split the rows of a RESULTS or REPLIES in two halves, outputs first."""
    middle = (len(outputs) + len(failures)) // 2
    if middle <= len(outputs):
        return (outputs[:middle], ()), (outputs[middle:], failures)
    cut = middle - len(outputs)
    return (outputs, failures[:cut]), ((), failures[cut:])


def _encode_inputs(
    command: Command,
    key: str,
    rows: Iterable[tuple[bytes, str, Tensors, float | None, tuple[bytes, ...]]],
) -> list[Frame]:
    """JOBS or REQUESTS: a spec table (model and tensors), one row per item, its frames."""
    specs = _SpecTable()
    lines: list[str] = []
    frames: list[Frame] = []
    for ident, model, tensors, milliseconds, group in rows:
        index = specs.index(tensors, model)
        ident_text, members = _row_id(ident, group), _members(tensors, group)
        lines.append(f"[{ident_text},{index},{_number(milliseconds)}{members}]")
        frames.extend(tensors.frames)
    body = f'{{"specs":[{specs.json()}],"{key}":[{",".join(lines)}]}}'
    return _frames(command, b"", body, frames)


def _encode_outputs(
    command: Command,
    keys: tuple[str, str],
    rows: Iterable[tuple[bytes, Tensors, Mapping[str, float] | str, tuple[bytes, ...]]],
    failures: tuple[Fail, ...],
) -> list[Frame]:
    """RESULTS or REPLIES: a spec table (tensors), one row per output, its frames, failures.
    A row's timing is a mapping, or its JSON text where that is known (``timing_json``)."""
    specs = _SpecTable()
    lines: list[str] = []
    frames: list[Frame] = []
    for ident, tensors, timing, group in rows:
        index = specs.index(tensors)
        ident_text, members = _row_id(ident, group), _members(tensors, group)
        text = timing if isinstance(timing, str) else _json(dict(timing))  # str: JSON already
        lines.append(f"[{ident_text},{index},{text}{members}]")
        frames.extend(tensors.frames)
    failed = ",".join(_json([f.job_id.hex(), f.code, f.message]) for f in failures)
    tail = f',"{keys[1]}":[{failed}]' if failures else ""
    body = f'{{"specs":[{specs.json()}],"{keys[0]}":[{",".join(lines)}]{tail}}}'
    return _frames(command, b"", body, frames)


def _row_id(ident: bytes, group: tuple[bytes, ...]) -> str:
    """A row's id: one hex id, or a group's list of them (REQUESTS, REPLIES)."""
    if not group:
        return f'"{ident.hex()}"'
    return "[" + ",".join(f'"{member.hex()}"' for member in group) + "]"


def _members(tensors: Tensors, group: tuple[bytes, ...]) -> str:
    """A JOBS or RESULTS row's fourth entry, the members of a group job (none for one)."""
    if group:  # a REQUESTS or REPLIES group: its ids count its members
        if tensors.members != len(group):
            raise ValueError(f"a group of {len(group)} ids carries {tensors.members} members")
        return ""
    return "" if tensors.members == 1 else f",{tensors.members}"


class _SpecTable:
    """The distinct tensor specs of a batch (with the model, for JOBS), as JSON entries."""

    __slots__ = ("_entries", "_index")

    def __init__(self) -> None:
        self._index: dict[tuple[str, str], int] = {}
        self._entries: list[str] = []

    def index(self, tensors: Tensors, model: str | None = None) -> int:
        specs = _specs_json(tensors)  # cached text: equal specs give the same (hashed) str
        key = (specs, model or "")
        found = self._index.get(key)
        if found is None:
            found = self._index[key] = len(self._entries)
            entry = specs if model is None else f'{{"model":{_json(model)},"tensors":{specs}}}'
            self._entries.append(entry)
        return found

    def json(self) -> str:
        return ",".join(self._entries)


# ---------------------------------------------------------------- decoding


def _pick(table: tuple[T, ...], indices: list[int], rows: str) -> list[T]:
    """The spec table entries rows refer to; an index past the table is a bad message."""
    if indices and max(indices) >= len(table):
        row = next(n for n, index in enumerate(indices) if index >= len(table))
        raise ProtocolError(
            f"{rows}[{row}] names spec {indices[row]}; the header lists {len(table)} spec(s)"
        )
    return [table[index] for index in indices]


InputRow: TypeAlias = tuple[bytes, str, Tensors, "float | None", tuple[bytes, ...]]
OutputRow: TypeAlias = tuple[bytes, Tensors, dict[str, float], tuple[bytes, ...]]


def _inputs(
    fields: dict[str, Any], frames: Sequence[Frame], key: str, command: Command, limits: Limits
) -> tuple[list[InputRow], tuple[Fail, ...]]:
    """The rows of a JOBS or REQUESTS as (id, model, tensors, milliseconds, group), and
    the rows whose frames do not match their specs as failures (one per group member)."""
    rows: tuple[Row[float | None], ...] = fields[key]
    picked = _pick(fields["specs"], [row[1] for row in rows], key)
    layouts = [(specs, row[3]) for row, (_model, specs) in zip(rows, picked, strict=True)]
    found = _batch_tensors(layouts, frames, command, limits)
    good: list[InputRow] = []
    rejected = []
    for (ident, _index, ms, _n, group), (model, _specs), tensors in zip(
        rows, picked, found, strict=True
    ):
        if isinstance(tensors, Tensors):
            good.append((ident, model, tensors, ms, group))
        else:
            rejected += [Fail.of(member, tensors) for member in group or (ident,)]
    return good, tuple(rejected)


def _outputs(
    fields: dict[str, Any],
    frames: Sequence[Frame],
    keys: tuple[str, str],
    command: Command,
    limits: Limits,
) -> tuple[list[OutputRow], tuple[Fail, ...]]:
    """The rows of a RESULTS or REPLIES as (id, tensors, timing, group), and its failures
    (those listed, then the rows whose frames do not match their specs, one per group
    member)."""
    rows: tuple[Row[dict[str, float]], ...] = fields[keys[0]]
    picked = _pick(fields["specs"], [row[1] for row in rows], keys[0])
    found = _batch_tensors(
        [(specs, row[3]) for row, specs in zip(rows, picked, strict=True)], frames, command, limits
    )
    good: list[OutputRow] = []
    failures = list(fields.get(keys[1], ()))
    for (ident, _index, timing, _n, group), tensors in zip(rows, found, strict=True):
        if isinstance(tensors, Tensors):
            good.append((ident, tensors, timing, group))
        else:
            if command is Command.RESULTS:  # the worker's outputs: never the client's fault
                why = f"the worker sent outputs the protocol refuses: {tensors}"
                tensors = WorkerFailedError(why)
            failures += [Fail.of(member, tensors) for member in group or (ident,)]
    return good, tuple(failures)
