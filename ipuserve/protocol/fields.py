"""The declared field types every header uses (names, ids, counts, durations, codes,
timings), their limits as ``msgspec.Meta`` constraints that msgspec checks while it
parses, and msgspec's refusals as ours (keeping the field's path, ``$.tensors[0]``).
What depends on a receiver's :class:`Limits` is checked after, by each message."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ipuserve.errors import InvalidInputError, IpuserveError, ProtocolError
from ipuserve.limits import MAX_DURATION_MS, MAX_NAME_CHARS, VERSION_PATTERN
from ipuserve.protocol.envelope import (
    MAX_COUNT,
    MAX_ID_BYTES,
    MAX_TIMING_KEYS,
    MAX_TIMING_VALUE,
    bounded,
)

#: A model, tensor, worker or timing name.
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
#: A model's version: a positive integer, as a string (a repository's ``NAME/VERSION/``
#: directory; ordered as numbers: "latest" is the largest): ipuserve.limits' one syntax.
Version = Annotated[str, Meta(pattern=VERSION_PATTERN)]
#: A job or request id, as hex (decoded by :func:`hex_id`: a pattern costs 3x the parse).
HexId = Annotated[str, Meta(max_length=2 * MAX_ID_BYTES)]
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Positive = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
#: Whole milliseconds a peer asks us to wait.
Interval = Annotated[int, Meta(ge=1, lt=int(MAX_DURATION_MS))]
#: A request's timeout: never spent already.
Duration = Annotated[float, Meta(gt=0, lt=MAX_DURATION_MS)]
#: A job's budget: the time left before its deadline (spent already: negative).
Budget = Annotated[float, Meta(gt=-MAX_DURATION_MS, lt=MAX_DURATION_MS)]
Code = Annotated[str, Meta(max_length=64, pattern=r"^[A-Z0-9_]*[A-Z][A-Z0-9_]*$")]
TimingValue = Annotated[float, Meta(gt=-MAX_TIMING_VALUE, lt=MAX_TIMING_VALUE)]
Timing = Annotated[dict[Name, TimingValue], Meta(max_length=MAX_TIMING_KEYS)]
#: The members of a group job; a receiver's max_batch bounds them further.
Members = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
#: The samples of a job, all members together (counted once, where the job is made).
Samples = Annotated[int, Meta(ge=1, le=MAX_COUNT)]


class Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A message's header: an object with exactly its declared fields."""


class Row(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A batch row: a JSON array of its fields in order (the trailing defaults optional,
    nothing after them: msgspec would skip extra entries, however deep, unread)."""


#: Where an error is the sender's input, not its protocol: a tensor's dtype or shape.
_INPUT_PATH = re.compile(r"\]\.(dtype|shape)\b")
#: The dtypes a tensor may have (ipuserve.protocol.tensors.DTYPES: their numpy dtypes).
DTYPE_NAMES: tuple[str, ...] = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16")
DTYPE_NAMES += ("uint32", "uint64", "float16", "float32", "float64")
_ALLOWED = f"; allowed: {', '.join(DTYPE_NAMES)}"
_ROW_PATH = re.compile(r"\$\.(\w+)\[(\d+)\](?:\[(\d+)\])?")
#: msgspec's refusal: its rule (the type, the limit), then a path or a key at a path.
_AT = re.compile(
    r"(?:Expected `([^`]+)`(?:, got `[^`]+`)?(.*?)(?:, got \d+)?|Number out of range)"
    r" - at `(key` in `)?(\$[^`]*)`"
)
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]|\[\.\.\.\]")
_NOUNS = {"str": "a string", "int": "an integer", "float": "a number", "array": "a list"}
_NOUNS |= {"object": "an object", "float | null": "a number or null"}
_UNTYPED = msgspec.json.Decoder(float_hook=Decimal)  # each number as sent: 1e400 too
_SHOW = msgspec.json.Encoder(decimal_format="number").encode


def refused(
    exc: msgspec.MsgspecError | UnicodeDecodeError,
    where: str,
    rows: Mapping[str, tuple[str, ...]],
    raw: bytes = b"",
) -> IpuserveError:
    """msgspec's refusal of the header ``raw`` as ours: the field's path, the value sent
    (read again from ``raw`` only now, so the valid path pays nothing) and the rule; a
    batch row's entry named by its field (``$.jobs[0].members``, not ``$.jobs[0][3]``),
    a row of the wrong shape with the shape (``rows``: each batch key's row fields)."""
    text = bounded(str(exc))
    if not isinstance(exc, msgspec.ValidationError):
        return ProtocolError(f"{where} is not valid UTF-8 JSON: {text}")
    precise = _precise(text, raw) or _long_row(text, raw, rows)
    text, located = (precise, precise.split(" ")[0]) if precise else (text, text)
    path = _ROW_PATH.search(text)
    names = rows.get(path.group(1), ()) if path is not None else ()
    if path is not None and names:
        if path.group(3) is None:
            text += f" (a row is [{', '.join(names)}])"
        elif int(path.group(3)) < len(names):
            named = f"$.{path.group(1)}[{path.group(2)}].{names[int(path.group(3))]}"
            text = text[: path.start()] + named + text[path.end() :]
    if _INPUT_PATH.search(located):  # the path's: not a value sent that quotes one
        hint = _ALLOWED if "enum value" in text else ""
        return InvalidInputError(f"{where}: {text}{hint}")
    return ProtocolError(f"{where}: {text}")


def _precise(text: str, raw: bytes) -> str | None:
    """``$.path is VALUE; it must be RULE`` for msgspec's ``Expected RULE - at $.path``,
    or None where the value cannot be found."""
    at = _AT.fullmatch(text)
    if at is None:
        return None
    try:  # ``raw`` was measured (codec.too_deep): bounded in bytes and depth
        path, value = _value_at(_UNTYPED.decode(raw), at.group(4), bool(at.group(3)))
    except Exception:  # best effort, never an error of its own: bad UTF-8 after the
        return None  # field, a Decimal("1e99999…") (InvalidOperation), a path not found
    shown = _SHOW(value).decode()
    shown = shown if len(shown) <= 60 else f"{shown[:40]}... ({len(shown)} characters)"
    kind, rule = at.group(1, 2)
    if kind is None:
        return f"{path} is {shown}: out of range"
    must = rule if rule and kind in ("int", "float") else _NOUNS.get(kind, f"`{kind}`") + rule
    is_ = "has the key" if at.group(3) else "is"
    return f"{path} {is_} {shown}; it must be {must.strip()}"


#: msgspec's refusal of a row with entries after its last field: it names no path
_LONG_ROW = re.compile(r"Expected `array` of at most length (\d+)")


def _long_row(text: str, raw: bytes, rows: Mapping[str, tuple[str, ...]]) -> str | None:
    """``$.key[n] has N entries; at most M`` for the first batch row longer than its
    fields, or None where msgspec refused something else (or it cannot be found)."""
    if _LONG_ROW.fullmatch(text) is None:
        return None
    try:  # ``raw`` was measured (codec.too_deep): bounded in bytes and depth
        header = _UNTYPED.decode(raw)
        key, n, count = next(
            (key, n, len(row))
            for key, names in rows.items()
            for n, row in enumerate(header.get(key) or ())
            if type(row) is list and len(row) > len(names)
        )
    except Exception:  # best effort, as _precise
        return None
    return f"$.{key}[{n}] has {count} entries; at most {len(rows[key])}"


def _value_at(header: Any, path: str, key: bool) -> tuple[str, Any]:
    """The value at msgspec's ``path`` in the untyped header, and the path to show: a
    map's entry ``[...]`` is the first no timing value (the one map the headers declare),
    a ``key`` the first that is no name."""
    shown, value = "$", header
    for step in _STEP.finditer(path, 1):
        name, index = step.groups()
        if index is None:
            name = name or next(k for k, v in value.items() if not _fits(v, TimingValue))
        shown += f".{name}" if step.group(1) else f"[{_SHOW(name or int(index)).decode()}]"
        value = value[int(index)] if index is not None else value[name]
    return (shown, next(k for k in value if not _fits(k, Name))) if key else (shown, value)


def _fits(value: Any, kind: Any) -> bool:
    try:
        msgspec.convert(value, kind)
    except Exception:  # a ValidationError; a 400-digit int makes msgspec raise SystemError
        return False
    return True


def hex_id(value: str, where: str) -> bytes:
    """A declared HexId as bytes; ``where`` names it when it is no hex."""
    found = peek_hex(value)
    if found is None:
        raise ProtocolError(f"{where}: {bounded(repr(value[:80]))} is not a hex job id")
    return found


def finite(value: float | None, what: str) -> float | None:
    """``value``, refused if JSON cannot carry it: msgspec writes NaN and infinities as
    null, which a receiver would read as no deadline (a budget or timeout)."""
    if value is None or math.isfinite(value):
        return value
    raise ValueError(f"{what} is {value}; only a finite number can travel")


def finite_timing(timing: Mapping[str, float]) -> dict[str, float]:
    """A timing to send, each value finite (one sum checks them all)."""
    copy = dict(timing)
    if not math.isfinite(sum(copy.values())):
        raise ValueError(f"timing {copy}: only finite numbers can travel")
    return copy


def at_most(count: int, limit: int, where: str) -> None:
    """Refuse ``count`` entries of ``where`` beyond a receiver's ``limit``."""
    if count > limit:
        raise ProtocolError(f"{where} has {count} entries; the limit is {limit}")


def peek_hex(value: Any) -> bytes | None:
    """A hex id from a header that may be malformed, else None."""
    if type(value) is not str or len(value) > 2 * MAX_ID_BYTES:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None
