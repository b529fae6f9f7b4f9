"""The one table: which HTTP status and gRPC status code each ipuserve error becomes.

Both doors answer from :data:`STATUS_TABLE` (most specific class first; the first class
an error is an instance of wins), and docs/gateway.md renders the same table
(:func:`table_rows`; tests/gateway/test_docs.py keeps the two in step).
"""

from __future__ import annotations

from ipuserve import errors

#: (error class, HTTP status, gRPC status code name), most specific first
STATUS_TABLE: tuple[tuple[type[BaseException], int, str], ...] = (
    (errors.UnauthenticatedError, 401, "UNAUTHENTICATED"),
    (errors.PermissionDeniedError, 403, "PERMISSION_DENIED"),
    (errors.UnknownModelError, 404, "NOT_FOUND"),
    (errors.PayloadTooLargeError, 413, "RESOURCE_EXHAUSTED"),
    (errors.OverloadedError, 503, "UNAVAILABLE"),
    # a load no worker has room for: the fleet may have room later (UNAVAILABLE is
    # what a client retries; RESOURCE_EXHAUSTED reads as "your request is too big")
    (errors.NoRoomError, 503, "UNAVAILABLE"),
    (errors.DeadlineExceeded, 504, "DEADLINE_EXCEEDED"),
    (errors.InvalidInputError, 400, "INVALID_ARGUMENT"),
    (errors.ProtocolError, 400, "INVALID_ARGUMENT"),
    (errors.RequestError, 400, "INVALID_ARGUMENT"),
    (errors.UnavailableError, 503, "UNAVAILABLE"),
    (errors.WorkerFailedError, 503, "UNAVAILABLE"),
    (errors.InferenceError, 500, "INTERNAL"),
    # the gateway's client closed under a request: the gateway is stopping
    (errors.ClosedError, 503, "UNAVAILABLE"),
)

#: what anything else becomes
FALLBACK: tuple[int, str] = (500, "INTERNAL")


def _lookup(exc: BaseException) -> tuple[int, str]:
    for cls, http, grpc in STATUS_TABLE:
        if isinstance(exc, cls):
            return http, grpc
    return FALLBACK


def http_status(exc: BaseException) -> int:
    """The HTTP status answering ``exc``."""
    return _lookup(exc)[0]


def grpc_status_name(exc: BaseException) -> str:
    """The name of the ``grpc.StatusCode`` answering ``exc`` (``"NOT_FOUND"``...)."""
    return _lookup(exc)[1]


def table_rows() -> list[tuple[str, str, int, str]]:
    """(error class, wire code, HTTP status, gRPC code) per row, fallback last: what
    docs/gateway.md shows."""
    rows = [
        (cls.__name__, getattr(cls, "code", ""), http, grpc) for cls, http, grpc in STATUS_TABLE
    ]
    return [*rows, ("anything else", "", *FALLBACK)]
