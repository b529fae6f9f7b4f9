"""Fast paths for the hot messages: a REQUEST whose header was seen before, and a
one-row JOBS, RESULTS or REPLY laid out as this package's encoders write them.

:func:`fast_decode` is tried first by :func:`ipuserve.protocol.codec.decode`. It
returns the message only when it is sure the full decoder would return the same
one, and None for anything else (an unknown layout, a spec table not yet seen, a
frame of the wrong size, any doubt): the full decoder then accepts the message or
refuses it with its own error. So the fast path changes what a message costs,
never what is accepted or refused, nor any error; tests/test_protocol_fastpath.py
compares both on valid messages and on random corruptions of them.

A RESULTS row's timing is still checked as the full decoder checks it (a JSON
object of at most MAX_TIMING_KEYS finite floats with short names); its JSON text is
kept on the :class:`Result` (``timing_json``) so that the broker's REPLY passes it
through, adding only its own entry, instead of parsing and re-formatting every float.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq

from ipuserve.limits import MAX_DURATION_MS, MAX_NAME_CHARS
from ipuserve.protocol.batches import Job, Jobs, Result, Results, _job_spec
from ipuserve.protocol.checks import _tensor_specs
from ipuserve.protocol.client_messages import Reply, Request
from ipuserve.protocol.envelope import (
    _ENVELOPES,
    ENTRY_OVERHEAD,
    MAX_TIMING_KEYS,
    MAX_TIMING_VALUE,
    CacheBudget,
    Command,
    Limits,
)
from ipuserve.protocol.tensors import Frame, Tensors, TensorSpec

#: (command, header bytes) -> (limits, validated fields), for the command whose headers
#: repeat (a client sends the same model, names, dtypes and shapes again and again).
#: Filled by the full decoder (codec._header_fields), read here first for a REQUEST.
#: The cached values are immutable (str, float, tuples of frozen specs). The limits
#: are compared, not hashed: a frozen dataclass hashes in Python, on every lookup.
FIELDS_CACHE: dict[tuple[Command, bytes], tuple[Limits, dict[str, Any]]] = {}
#: its bound: the header's bytes count twice (the key, and the fields parsed from it)
FIELDS_BUDGET = CacheBudget()

_MAX_ENVELOPE = len(_ENVELOPES[Command.REQUEST]) + 64  # tag, version, command, id


def fast_decode(frames: Sequence[Frame], limits: Limits) -> Any:
    """The message, when a fast path is sure of it; else None (decode it fully)."""
    if len(frames) < 2:
        return None
    head = frames[0]
    body = frames[1]
    if type(head) is zmq.Frame:  # what sockets give
        head = head.bytes
    elif type(head) is not bytes:
        return None
    if len(head) > _MAX_ENVELOPE:
        return None
    handler = _HANDLERS.get(head[:6])
    if handler is None:
        return None
    raw = body.bytes if type(body) is zmq.Frame else body
    if type(raw) is not bytes or len(raw) > limits.max_header_bytes:
        return None
    return handler(head[6:], raw, frames, limits)


def _request(ident: bytes, raw: bytes, frames: Sequence[Frame], limits: Limits) -> Any:
    cached = FIELDS_CACHE.get((Command.REQUEST, raw))
    if cached is None or not (cached[0] is limits or cached[0] == limits):
        return None
    fields = cached[1]
    tensors = _exact(fields["tensors"], frames, 1, limits)
    if tensors is None:
        return None
    return Request(ident, fields["model"], tensors, fields.get("timeout_ms"))


def _exact(
    specs: tuple[TensorSpec, ...], frames: Sequence[Frame], members: int, limits: Limits
) -> Tensors | None:
    """The tensors of the one job whose frames follow the header, if each frame has
    exactly its spec's size and the payload is within the limit (else None)."""
    given = frames[2:]
    if len(given) != len(specs):
        return None
    declared = 0
    for spec, frame in zip(specs, given):  # noqa: B905  (lengths checked above)
        size = spec.nbytes
        declared += size
        kind = type(frame)
        if (kind is not zmq.Frame and kind is not bytes) or len(frame) != size * members:
            return None
    if declared > limits.max_payload_bytes:
        return None
    return Tensors(specs, tuple(given), members)


# A one-row RESULTS or REPLY as the encoders write it: no whitespace, lower-case hex
# ids, spec index 0, a timing object without nested values, printable ASCII only.
_SPECS = rb"(\[(?:\{[^{}]*\}(?:,\{[^{}]*\})*)?\])"
_TIMING = rb"(\{[\x20-\x5a\x5e-\x7a\x7c\x7e]*\})"  # printable ASCII but [ \ ] { }
_RESULTS_RE = re.compile(
    rb'\{"specs":\['
    + _SPECS
    + rb'\],"results":\[\["([0-9a-f]{0,128})",0,'
    + _TIMING
    + rb"(?:,([1-9][0-9]{0,8}))?\]\]\}"
)
_NUMBER = rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"  # JSON's grammar
_ENTRY = rb'(\{"model":"[^"\\]*","tensors":' + _SPECS + rb"\})"
_JOBS_RE = re.compile(
    rb'\{"specs":\['
    + _ENTRY
    + rb'\],"jobs":\[\["([0-9a-f]{0,128})",0,(null|'
    + _NUMBER
    + rb")(?:,([1-9][0-9]{0,8}))?\]\]\}"
)
_REPLY_RE = re.compile(rb'\{"tensors":' + _SPECS + rb',"timing":' + _TIMING + rb"\}")


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


#: the full decoder's JSON reading (NaN and Infinity refused), and its scanner
_DECODER = json.JSONDecoder(parse_constant=_refuse)
_SCAN: Callable[[str, int], tuple[Any, int]] = getattr(_DECODER, "scan_once")  # noqa: B009


def _results(_ident: bytes, raw: bytes, frames: Sequence[Frame], limits: Limits) -> Any:
    found = _RESULTS_RE.fullmatch(raw)
    if found is None or limits.max_batch < 1:
        return None
    specs_text, hex_id, timing_text, count = found.groups()
    specs = _specs(specs_text, limits)
    if specs is None:
        return None
    members = 1
    if count is not None:
        members = int(count)
        if members > limits.max_batch:
            return None
    timing_json = timing_text.decode("ascii")
    timing = _timing(timing_json)
    if timing is None or len(hex_id) % 2:
        return None
    tensors = _exact(specs, frames, members, limits)
    if tensors is None:
        return None
    return Results((Result(bytes.fromhex(hex_id.decode()), tensors, timing, timing_json),))


def _jobs(_ident: bytes, raw: bytes, frames: Sequence[Frame], limits: Limits) -> Any:
    found = _JOBS_RE.fullmatch(raw)
    if found is None or limits.max_batch < 1:
        return None
    entry_text, _specs_text, hex_id, budget_text, count = found.groups()
    entry = _entry(entry_text, limits)
    if entry is None or len(hex_id) % 2:
        return None
    members = 1
    if count is not None:
        members = int(count)
        if members > limits.max_batch:
            return None
    budget: float | None = None
    if budget_text != b"null":
        # a JSON integer is read as one, then made a float, as the full check does
        integral = b"." not in budget_text and b"e" not in budget_text.lower()
        budget = float(int(budget_text)) if integral else float(budget_text)
        if not -MAX_DURATION_MS < budget < MAX_DURATION_MS:
            return None
    tensors = _exact(entry[1], frames, members, limits)
    if tensors is None:
        return None
    return Jobs((Job(bytes.fromhex(hex_id.decode()), entry[0], tensors, budget),))


def _reply(ident: bytes, raw: bytes, frames: Sequence[Frame], limits: Limits) -> Any:
    found = _REPLY_RE.fullmatch(raw)
    if found is None:
        return None
    specs_text, timing_text = found.groups()
    specs = _specs(specs_text, limits)
    if specs is None:
        return None
    timing = _timing(timing_text.decode("ascii"))
    if timing is None:
        return None
    tensors = _exact(specs, frames, 1, limits)
    if tensors is None:
        return None
    return Reply(ident, tensors, timing)


def _timing(text: str) -> dict[str, float] | None:
    """A timing object the full check would take as it is (ipuserve.protocol.checks.
    _plain_timing: float values in range, at most MAX_TIMING_KEYS short names)."""
    try:
        timing, end = _SCAN(text, 0)
    except (ValueError, StopIteration, RecursionError):
        return None
    if end != len(text) or type(timing) is not dict or len(timing) > MAX_TIMING_KEYS:
        return None
    for key, number in timing.items():
        if (
            type(number) is not float
            or not 0 < len(key) <= MAX_NAME_CHARS
            or not -MAX_TIMING_VALUE < number < MAX_TIMING_VALUE
        ):
            return None
    return timing


#: spec list JSON text -> (limits, its checked specs): results and replies repeat them.
_SPEC_TEXTS: dict[bytes, tuple[Limits, tuple[TensorSpec, ...]]] = {}
_SPEC_TEXTS_BUDGET = CacheBudget()


T = TypeVar("T")

#: JOBS spec table entry JSON text -> (limits, its checked model name and specs)
_ENTRIES: dict[bytes, tuple[Limits, tuple[str, tuple[TensorSpec, ...]]]] = {}
_ENTRIES_BUDGET = CacheBudget()


def _checked(
    table: dict[bytes, tuple[Limits, T]],
    budget: CacheBudget,
    text: bytes,
    limits: Limits,
    check: Callable[..., T],
) -> T | None:
    """``check(json of text, limits)`` as the full decoder runs it, remembered by the text
    (None if it refuses it: the full decoder then says why)."""
    found = table.get(text)
    if found is not None and (found[0] is limits or found[0] == limits):
        return found[1]
    try:
        value = check(_DECODER.decode(text.decode("utf-8")), limits)
    except Exception:  # any refusal: the full decoder says why
        return None
    if budget.admit(table, 2 * len(text) + ENTRY_OVERHEAD):
        table[text] = (limits, value)
    return value


def _entry(text: bytes, limits: Limits) -> tuple[str, tuple[TensorSpec, ...]] | None:
    """A JOBS spec table entry, checked as the full decoder checks it (else None)."""
    return _checked(_ENTRIES, _ENTRIES_BUDGET, text, limits, _job_spec)


def _specs(text: bytes, limits: Limits) -> tuple[TensorSpec, ...] | None:
    """A tensor spec list, checked as the full decoder checks it (else None)."""
    return _checked(_SPEC_TEXTS, _SPEC_TEXTS_BUDGET, text, limits, _tensor_specs)


_HANDLERS: dict[bytes, Callable[[bytes, bytes, Sequence[Frame], Limits], Any]] = {
    _ENVELOPES[Command.REQUEST]: _request,
    _ENVELOPES[Command.RESULTS]: _results,
    _ENVELOPES[Command.REPLY]: _reply,
    _ENVELOPES[Command.JOBS]: _jobs,
}
