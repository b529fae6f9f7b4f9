"""The rows of a batch (JOBS, RESULTS, REQUESTS, REPLIES): ``[id hex, spec index,
third entry(, members)]``, each checked into a :data:`Row`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from ipuserve.errors import ProtocolError
from ipuserve.limits import MAX_DURATION_MS
from ipuserve.protocol.checks import (
    T,
    _budget,
    _count,
    _duration,
    _item_at,
    _items,
    _job_id,
    _list,
    _optional,
    _plain_timing,
    _show,
    _timing,
)
from ipuserve.protocol.envelope import MAX_ID_BYTES, Limits

#: A checked batch row: (id, spec index, third entry, members, the group's ids or ()).
Row: TypeAlias = tuple[bytes, int, T, int, tuple[bytes, ...]]


def _job_row(item: Any, limits: Limits) -> Row[float | None]:
    if type(item) is not list or len(item) not in (3, 4):
        raise ProtocolError(
            f"must be [job id, spec index, budget_ms(, members)]; got {_show(item)}"
        )
    members = _group_size(item[3], limits) if len(item) == 4 else 1
    return _job_id(item[0], limits), _count(item[1], limits), _budget(item[2], limits), members, ()


def _result_row(item: Any, limits: Limits) -> Row[dict[str, float]]:
    if type(item) is not list or len(item) not in (3, 4):
        raise ProtocolError(f"must be [job id, spec index, timing(, members)]; got {_show(item)}")
    members = _group_size(item[3], limits) if len(item) == 4 else 1
    return _job_id(item[0], limits), _count(item[1], limits), _timing(item[2], limits), members, ()


def _request_row(item: Any, limits: Limits) -> Row[float | None]:
    if type(item) is not list or len(item) != 3:
        raise ProtocolError(
            f"must be [request id or [request ids], spec index, timeout_ms]; got {_show(item)}"
        )
    ident, group = _row_ids(item[0], limits)
    timeout = _timeout(item[2], limits)
    return ident, _count(item[1], limits), timeout, len(group) or 1, group


#: A REQUESTS row's timeout: null, or milliseconds > 0.
_timeout = _optional(_duration)


def _reply_row(item: Any, limits: Limits) -> Row[dict[str, float]]:
    if type(item) is not list or len(item) != 3:
        raise ProtocolError(
            f"must be [request id or [request ids], spec index, timing]; got {_show(item)}"
        )
    ident, group = _row_ids(item[0], limits)
    return ident, _count(item[1], limits), _timing(item[2], limits), len(group) or 1, group


def _row_ids(value: Any, limits: Limits) -> tuple[bytes, tuple[bytes, ...]]:
    """A REQUESTS or REPLIES row's id, or a group's ids (then the first is the row's id)."""
    if type(value) is not list:
        return _job_id(value, limits), ()
    group = _items(value, limits.max_batch, _job_id, limits)
    if not group:
        raise ProtocolError("a group lists no ids")
    if len(set(group)) != len(group):
        raise ProtocolError("a group lists an id twice")
    return group[0], group


def _group_size(value: Any, limits: Limits) -> int:
    if type(value) is not int or not 1 <= value <= limits.max_batch:
        raise ProtocolError(
            f"members must be an integer in 1..{limits.max_batch}; got {_show(value)}"
        )
    return value


def _job_rows(value: Any, limits: Limits) -> tuple[Row[float | None], ...]:
    return _batch_rows(value, limits, _plain_budget, _job_row)


def _request_rows(value: Any, limits: Limits) -> tuple[Row[float | None], ...]:
    return _batch_rows(value, limits, _plain_timeout, _request_row)


def _result_rows(value: Any, limits: Limits) -> tuple[Row[dict[str, float]], ...]:
    return _batch_rows(value, limits, _plain_timing, _result_row)


def _reply_rows(value: Any, limits: Limits) -> tuple[Row[dict[str, float]], ...]:
    return _batch_rows(value, limits, _plain_timing, _reply_row)


def _batch_rows(
    value: Any,
    limits: Limits,
    plain_third: Callable[[Any], bool],
    full_check: Callable[[Any, Limits], Row[T]],
) -> tuple[Row[T], ...]:
    """Rows of a batch, ``[id hex, spec index, third]``. The usual row passes
    one inline test (``plain_third`` for its third entry); any other row (a group,
    too) gets ``full_check``, which accepts it or says what is wrong and where.

    Both paths are kept on purpose: the inline test accepts exactly what the full
    check accepts for a single row, and costs fewer calls. Measured with cProfile
    (function calls per decode, caches warm): JOBS of 32 jobs 765 with it, 1213
    without (14 calls a row); RESULTS of 32 results with 3 timings 1087 against
    1471 (12 a row). tests/test_protocol_package.py checks that both give the same rows.
    """
    checked: list[Row[T]] = []
    single: tuple[bytes, ...] = ()
    for index, row in enumerate(_list(value, limits.max_batch)):
        if type(row) is list and len(row) == 3:
            job_id, spec, third = row
            if (
                type(spec) is int
                and spec >= 0
                and plain_third(third)
                and (raw := _hex_id(job_id)) is not None
            ):
                checked.append((raw, spec, third, 1, single))
                continue
        checked.append(_item_at(index, row, full_check, limits))
    return tuple(checked)


def _plain_budget(value: Any) -> bool:
    """A budget as senders write it (null, or a float well inside the JSON range)."""
    return value is None or (type(value) is float and -MAX_DURATION_MS < value < MAX_DURATION_MS)


def _plain_timeout(value: Any) -> bool:
    """A request's timeout as senders write it (null, or a float > 0 in range)."""
    return value is None or (type(value) is float and 0 < value < MAX_DURATION_MS)


def _hex_id(value: Any) -> bytes | None:
    """A job id in hex, or None for anything the full check must look at."""
    if type(value) is not str or len(value) > 2 * MAX_ID_BYTES:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


