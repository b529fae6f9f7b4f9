"""A job's failure, as RESULTS, REPLIES, JOBS and REQUESTS carry it, and which codes
a worker may send: the broker turns any other into WORKER_FAILED, so that no worker can
make a client wait for ever (BROKER_SHUTDOWN) or blame its valid request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from ipuserve.errors import (
    DeadlineExceeded,
    InferenceError,
    InvalidInputError,
    IpuserveError,
    OverloadedError,
    PayloadTooLargeError,
    ProtocolError,
    UnavailableError,
    UnknownModelError,
    WorkerFailedError,
    error_for_code,
)
from ipuserve.protocol.envelope import bounded
from ipuserve.protocol.fields import Code, HexId, Row, hex_id


class Coded:
    """An error as it travels: an id, a wire code from ipuserve.errors and a message
    (a job's :class:`Fail`, a request's ERROR)."""

    __slots__ = ()
    code: str
    message: str

    if TYPE_CHECKING:  # the dataclasses below define it

        def __init__(self, ident: bytes, code: str, message: str) -> None: ...

    @classmethod
    def of(cls, ident: bytes, error: IpuserveError) -> Self:
        return cls(ident, error.code, bounded(str(error)))

    def exception(self) -> IpuserveError:
        return error_for_code(self.code, self.message)


@dataclass(frozen=True, slots=True)
class Fail(Coded):
    """A job that failed."""

    job_id: bytes
    code: str
    message: str

    def worker_exception(self) -> IpuserveError:
        """:meth:`exception` for a failure a worker sent: a code outside WORKER_CODES is
        the worker's fault, and the client hears WORKER_FAILED."""
        if self.code in WORKER_CODES:
            return error_for_code(self.code, self.message)
        return WorkerFailedError(
            f"the worker failed the job with {self.code!r}, which a worker may not send: "
            f"{self.message}"
        )


#: The failure codes a worker may send for a job (docs/protocol.md §4), all defined
#: here: its refusals, a model that raised, its backend closing, a JOBS it could not
#: read. Any other (BROKER_SHUTDOWN, which the Client keeps pending until its timeout;
#: a code no error class has) becomes WORKER_FAILED at the broker.
WORKER_CODES = frozenset(
    cls.code
    for cls in (
        ProtocolError,
        UnknownModelError,
        InvalidInputError,
        PayloadTooLargeError,
        OverloadedError,
        DeadlineExceeded,
        WorkerFailedError,
        InferenceError,
        UnavailableError,
    )
)


class FailRow(Row, frozen=True):
    """A failure as RESULTS and REPLIES list it: ``[job id hex, code, message]``."""

    job_id: HexId
    code: Code
    message: str

    @classmethod
    def of(cls, fail: Fail) -> FailRow:
        return cls(fail.job_id.hex(), fail.code, bounded(fail.message))

    def fail(self, where: str) -> Fail:
        return Fail(hex_id(self.job_id, where), self.code, self.message)
