"""Validating what a peer sent: frame sizes, header fields, tensor specs and frames.

A check takes (value, limits) and raises without saying where; the caller that
knows the location (a header field, a list index) adds it on the way out, so the
valid path never formats a location string. :class:`_Decoder` describes how one
command's header is checked and turned into its message; each message module
defines its decoders beside its classes, and :mod:`ipuserve.protocol.codec` looks
them up by envelope.

The names with a leading underscore are for the protocol package's modules only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, TypeVar

import numpy as np
import zmq

from ipuserve.errors import (
    InvalidInputError,
    IpuserveError,
    PayloadTooLargeError,
    ProtocolError,
)
from ipuserve.limits import MAX_DURATION_MS, MAX_NAME_CHARS, NAME_RULE, name_problem
from ipuserve.protocol.envelope import (
    ENTRY_OVERHEAD,
    MAX_COUNT,
    MAX_ID_BYTES,
    MAX_TIMING_KEYS,
    MAX_TIMING_VALUE,
    CacheBudget,
    Command,
    Limits,
)
from ipuserve.protocol.schema import ModelSpec
from ipuserve.protocol.tensors import DTYPES, Frame, Tensors, TensorSpec

Check: TypeAlias = Callable[[Any, Limits], Any]
T = TypeVar("T")
M_co = TypeVar("M_co", covariant=True)

# ---------------------------------------------------------------- frames


def _small(frame: Frame) -> bytes:
    if isinstance(frame, zmq.Frame):  # what sockets give: tested first
        return frame.bytes
    return frame if isinstance(frame, bytes) else bytes(frame)


def _nbytes(frame: Frame) -> int:
    kind = type(frame)
    if kind is zmq.Frame or kind is bytes:
        return len(frame)
    return frame.nbytes if isinstance(frame, np.ndarray | memoryview) else len(frame)


# ---------------------------------------------------------------- headers and tensors


@dataclass(frozen=True, slots=True)
class _Field:
    check: Check
    required: bool = True


def _check_fields(
    header: dict[str, Any], schema: Mapping[str, _Field], where: str, limits: Limits
) -> dict[str, Any]:
    if len(header) > len(schema) or any(key not in schema for key in header):
        unknown = ", ".join(_show(key) for key in header if key not in schema)
        raise ProtocolError(
            f"{where} has unknown field(s) {unknown}; expected {', '.join(schema) or 'none'}"
        )
    fields = {}
    for key, spec in schema.items():
        value = header.get(key, _MISSING)
        if value is _MISSING:
            if spec.required:
                raise ProtocolError(f"{where} is missing field {key!r}")
            continue
        try:
            fields[key] = spec.check(value, limits)
        except IpuserveError as exc:
            raise _at(f"{where} field {key!r}", exc) from None
    return fields


_MISSING = object()


def _tensors(
    specs: tuple[TensorSpec, ...],
    frames: Sequence[Frame],
    where: str,
    limits: Limits,
    members: int = 1,
) -> Tensors:
    """The tensors of one request or job (a group's: each frame holds every member's):
    as many frames as specs, each of the right size; the payload limit holds per member."""
    if len(frames) != len(specs):
        raise ProtocolError(
            f"{where} lists {len(specs)} tensor(s) but {len(frames)} tensor frame(s) follow"
        )
    declared = sum(spec.nbytes for spec in specs)
    if declared > limits.max_payload_bytes:
        raise PayloadTooLargeError(
            f"the tensors take {declared} bytes; the limit is {limits.max_payload_bytes}"
        )
    for spec, frame in zip(specs, frames, strict=True):
        if _nbytes(frame) != spec.nbytes * members:
            each = f" for each of {members} members" if members > 1 else ""
            raise InvalidInputError(
                f"tensor {spec.name!r} ({spec.dtype}{list(spec.shape)}) needs {spec.nbytes} "
                f"bytes{each}; its frame has {_nbytes(frame)}"
            )
    return Tensors(specs, tuple(frames), members)


def _batch_tensors(
    specs: list[tuple[tuple[TensorSpec, ...], int]],
    frames: Sequence[Frame],
    command: Command,
    limits: Limits,
) -> list[Tensors | IpuserveError]:
    """Each job's tensors (specs and members), its frames taken in order: a job whose
    frames do not match its specs gets the error instead, so one bad job does not fail
    the others (a group is one job: it fails whole)."""
    expected = sum(len(s) for s, _members in specs)
    if expected != len(frames):
        raise ProtocolError(
            f"{command.name} header lists {expected} tensor(s) but "
            f"{len(frames)} tensor frame(s) follow"
        )
    found: list[Tensors | IpuserveError] = []
    start = 0
    for job_specs, members in specs:
        end = start + len(job_specs)
        try:
            found.append(_tensors(job_specs, frames[start:end], "", limits, members))
        except (InvalidInputError, PayloadTooLargeError) as exc:
            found.append(exc)
        start = end
    return found


# ---------------------------------------------------------------- field checks


def _at(where: str, error: IpuserveError) -> IpuserveError:
    """The same error, its message prefixed with where it happened (ProtocolError only:
    InvalidInputError messages already name their tensor)."""
    if isinstance(error, ProtocolError):
        return type(error)(f"{where}: {error}")
    return error


def _kind(value: Any, types: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
        raise ProtocolError(f"must be {what}; got {json.dumps(value)[:80]}")


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _name(value: Any, _limits: Limits) -> str:
    _kind(value, str, NAME_RULE)  # a JSON value: shown as JSON if it is no string
    problem = name_problem(value)
    if problem is not None:
        raise ProtocolError(problem)
    return str(value)


def _text(value: Any, _limits: Limits) -> str:
    _kind(value, str, "a string")
    return str(value)


def _count(value: Any, _limits: Limits) -> int:
    _kind(value, int, "an integer >= 0")
    if not 0 <= value <= MAX_COUNT:  # JSON integers are unbounded; floats of them are not
        raise ProtocolError(f"must be >= 0 and <= {MAX_COUNT}; got {_shown(value)}")
    return int(value)


def _positive(value: Any, limits: Limits) -> int:
    if _count(value, limits) < 1:
        raise ProtocolError(f"must be >= 1; got {value}")
    return int(value)


def _shown(number: Any) -> str:
    """A number for an error message: a 400-digit one as its start and its length."""
    text = str(number)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} digits)"


def _interval(value: Any, limits: Limits) -> int:
    """Whole milliseconds a peer asks us to wait: > 0 and within MAX_DURATION_MS."""
    if _positive(value, limits) >= MAX_DURATION_MS:
        raise ProtocolError(f"must be < {MAX_DURATION_MS:g} milliseconds; got {value}")
    return int(value)


def _duration(value: Any, _limits: Limits) -> float:
    _kind(value, (int, float), "a number of milliseconds > 0")
    if not 0 < value < MAX_DURATION_MS:
        raise ProtocolError(f"must be > 0 and < {MAX_DURATION_MS:g} milliseconds; got {value}")
    return float(value)


def _optional(check: Check) -> Check:
    def checked(value: Any, limits: Limits) -> Any:
        return None if value is None else check(value, limits)

    return checked


def _budget(value: Any, _limits: Limits) -> float | None:
    if value is None:
        return None
    _kind(value, (int, float), "a number of milliseconds or null")
    if not -MAX_DURATION_MS < value < MAX_DURATION_MS:
        raise ProtocolError(f"is out of range: {value}")
    return float(value)


def _code(value: Any, _limits: Limits) -> str:
    _kind(value, str, "an error code")
    if not (0 < len(value) <= 64 and value.replace("_", "").isalnum() and value.isupper()):
        raise ProtocolError(f"must be an UPPER_CASE error code; got {value[:80]!r}")
    return str(value)


def _timing(value: Any, limits: Limits) -> dict[str, float]:
    """A timing object; the usual one (float values) passes :func:`_plain_timing`, which
    accepts nothing the checks below refuse, in fewer calls: a REPLY with 3 timings
    decodes in 63 calls (cProfile, caches warm) against 78 through the full checks."""
    if _plain_timing(value):
        return value  # type: ignore[no-any-return]
    _kind(value, dict, "an object of numbers")
    if len(value) > MAX_TIMING_KEYS:
        raise ProtocolError(f"has {len(value)} entries; the limit is {MAX_TIMING_KEYS}")
    floats = True
    for key, number in value.items():
        _name(key, limits)
        if type(number) is not float:
            if type(number) is not int:
                raise ProtocolError(f"must be an object of numbers; {key!r} is {number!r}"[:120])
            floats = False
        if not -MAX_TIMING_VALUE < number < MAX_TIMING_VALUE:  # also inf and NaN
            raise ProtocolError(f"{key!r} is out of range: {_shown(number)}")
    return value if floats else {key: float(number) for key, number in value.items()}


def _plain_timing(value: Any) -> bool:
    """A timing object as senders write it (float values, short names): used as it is."""
    if type(value) is not dict or len(value) > MAX_TIMING_KEYS:
        return False
    return all(
        type(number) is float
        and 0 < len(key) <= MAX_NAME_CHARS
        and -MAX_TIMING_VALUE < number < MAX_TIMING_VALUE  # JSON's 1e400 is inf
        for key, number in value.items()
    )


def _list(value: Any, limit: int) -> list[Any]:
    _kind(value, list, "a list")
    if len(value) > limit:
        raise ProtocolError(f"has {len(value)} entries; the limit is {limit}")
    return value  # type: ignore[no-any-return]


def _items(
    value: Any, limit: int, check: Callable[[Any, Limits], T], limits: Limits
) -> tuple[T, ...]:
    """Check each entry of a JSON list, naming the index of a bad one."""
    checked = []
    for index, item in enumerate(_list(value, limit)):
        try:
            checked.append(check(item, limits))
        except IpuserveError as exc:
            raise _at(f"[{index}]", exc) from None
    return tuple(checked)


def _tensor_specs(value: Any, limits: Limits) -> tuple[TensorSpec, ...]:
    specs = _items(value, limits.max_tensors, _tensor_spec, limits)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"a tensor is named twice: {names}")
    return specs


_SPEC_KEYS = {"name", "dtype", "shape"}


def _tensor_spec(item: Any, limits: Limits) -> TensorSpec:
    if type(item) is not dict or item.keys() != _SPEC_KEYS:
        _kind(item, dict, "an object {name, dtype, shape}")
        raise ProtocolError(
            f"must have exactly the fields name, dtype, shape; got {', '.join(item)}"
        )
    name = _name(item["name"], limits)
    dtype = item["dtype"]
    if type(dtype) is not str or dtype not in DTYPES:
        raise InvalidInputError(
            f"tensor {name!r} has dtype {json.dumps(dtype)[:40]}; allowed: {', '.join(DTYPES)}"
        )
    return TensorSpec(name, dtype, _shape(item["shape"], name, limits))


def _shape(value: Any, name: str, limits: Limits) -> tuple[int, ...]:
    if type(value) is not list or len(value) > limits.max_rank:
        raise InvalidInputError(
            f"tensor {name!r} shape must be a list of at most "
            f"{limits.max_rank} integers; got {json.dumps(value)[:80]}"
        )
    elements = 1
    for dim in value:
        if type(dim) is not int or dim < 0:
            raise InvalidInputError(
                f"tensor {name!r} shape {json.dumps(value)[:80]} must hold integers >= 0"
            )
        if dim > limits.max_elements:  # even beside a 0: numpy cannot make such a view
            raise InvalidInputError(
                f"tensor {name!r} shape {json.dumps(value)[:80]} has a dimension above "
                f"{limits.max_elements}"
            )
        elements *= dim
        if elements > limits.max_elements:
            raise InvalidInputError(
                f"tensor {name!r} shape {value} has more than {limits.max_elements} elements"
            )
    return tuple(value)


def _model_spec(value: Any, limits: Limits) -> ModelSpec:
    fields = _check_fields(_as_object(value), _MODEL_SCHEMA, "model spec", limits)
    spec = ModelSpec(
        fields["name"],
        fields["inputs"],
        fields["outputs"],
        fields["batch_size"],
        fields["batching_dim"],
    )
    dim = spec.batching_dim
    if dim is not None and any(dim >= len(t.shape) for t in spec.inputs + spec.outputs):
        raise ProtocolError(f"batching_dim {dim} exceeds the rank of a tensor")
    return spec


def _as_object(value: Any) -> dict[str, Any]:
    _kind(value, dict, "an object")
    return value  # type: ignore[no-any-return]


def _model_specs(value: Any, limits: Limits) -> tuple[ModelSpec, ...]:
    return _items(value, 1024, _model_spec, limits)


def _job_id(item: Any, _limits: Limits) -> bytes:
    _kind(item, str, "a hex job id")
    try:
        job_id = bytes.fromhex(item)
    except ValueError:
        raise ProtocolError(f"{item[:80]!r} is not a hex job id") from None
    if len(job_id) > MAX_ID_BYTES:
        raise ProtocolError(f"a job id is longer than {MAX_ID_BYTES} bytes")
    return job_id


def _job_ids(value: Any, limits: Limits) -> tuple[bytes, ...]:
    return _items(value, 1_000_000, _job_id, limits)


def _item_at(index: int, item: Any, check: Callable[[Any, Limits], T], limits: Limits) -> T:
    try:
        return check(item, limits)
    except IpuserveError as exc:
        raise _at(f"[{index}]", exc) from None


def _memo(check: Check) -> Check:
    """``check``, remembered by the checked value's repr.

    For parsed JSON the repr is exact (it tells 1 from 1.0 and from True), so each
    distinct spec list or spec table is checked once; the results are immutable.
    A batch's or a reply's specs repeat from message to message.
    """
    memo: dict[str, tuple[Limits, Any]] = {}
    budget = CacheBudget()

    def checked(value: Any, limits: Limits) -> Any:
        try:
            key = repr(value)
        except RecursionError:  # nested deeper than any valid value: the check refuses it
            return check(value, limits)
        found = memo.get(key)
        if found is not None and (found[0] is limits or found[0] == limits):
            return found[1]
        result = check(value, limits)
        if budget.admit(memo, 2 * len(key) + ENTRY_OVERHEAD):  # the value: about its repr
            memo[key] = (limits, result)
        return result

    return checked


def _show(value: Any) -> str:
    return json.dumps(value)[:80]


def _rows(check: Callable[[Any, Limits], T]) -> Check:
    def rows(value: Any, limits: Limits) -> tuple[T, ...]:
        return _items(value, limits.max_batch, check, limits)

    return rows


# ---------------------------------------------------------------- decoders

_TENSORS = _Field(_memo(_tensor_specs))
_MODEL_SCHEMA = {
    "name": _Field(_name),
    "inputs": _TENSORS,
    "outputs": _TENSORS,
    "batch_size": _Field(_positive),
    "batching_dim": _Field(_optional(_count)),
}

# Which tensor frames a command carries: none, one request's, or a batch's (job by job).
_NONE, _ONE, _BATCH = 0, 1, 2


@dataclass(frozen=True, slots=True)
class _Decoder(Generic[M_co]):
    """How one command's header is checked (``schema``) and its message built: ``build``
    takes the envelope's id, the checked fields, the tensor frames and the limits."""

    command: Command
    schema: Mapping[str, _Field]
    build: Callable[[bytes, dict[str, Any], Sequence[Frame], Limits], M_co]
    tensors: int = _NONE
    cacheable: bool = False
    #: how error messages name the header (kept: an enum's name is a property)
    where: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "where", f"{self.command.name} header")

    def check(self, header: dict[str, Any], limits: Limits) -> dict[str, Any]:
        return _check_fields(header, self.schema, self.where, limits)

    def max_frames(self, limits: Limits) -> int:
        """Tensor frames a message of this kind may carry, checked before its header is read."""
        return (0, limits.max_tensors, limits.max_batch * limits.max_tensors)[self.tensors]
