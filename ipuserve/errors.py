"""The one exception tree of ipuserve.

Every error raised by ipuserve, in any process, is an :class:`IpuserveError`.
Errors that cross the wire carry a stable ``code``; the client re-raises the
class the broker or worker reported, so ``except OverloadedError`` works the
same in-process and across the network::

    IpuserveError
    ├── ConfigError                  bad config, CLI/env value or argument
    ├── ProtocolError                a frame not following docs/protocol.md      BAD_MESSAGE
    │   └── UnsupportedVersionError  another protocol version                    UNSUPPORTED_VERSION
    ├── RequestError                 the request was understood and refused
    │   ├── UnauthenticatedError     no valid token, or a revoked CURVE key      UNAUTHENTICATED
    │   ├── UnknownModelError        no worker serves (or served) that model     UNKNOWN_MODEL
    │   ├── InvalidInputError        bad name, dtype, shape or byte count        INVALID_INPUT
    │   ├── PayloadTooLargeError     over the configured size limit              PAYLOAD_TOO_LARGE
    │   ├── OverloadedError          the model's queue is full                   OVERLOADED
    │   └── DeadlineExceeded         no result in time (also a TimeoutError)     DEADLINE_EXCEEDED
    ├── ServingError                 the system failed to produce a result
    │   ├── WorkerFailedError        workers died holding the request too often  WORKER_FAILED
    │   ├── InferenceError           the model raised while running              INFERENCE_FAILED
    │   └── UnavailableError         broker unreachable / shutting down          UNAVAILABLE
    │       ├── BrokerShutdownError  a stopping broker let go; Client re-sends   BROKER_SHUTDOWN
    │       └── HandshakeRefusedError  the broker refused the connection (keys)  HANDSHAKE_REFUSED
    ├── ModelFileError               a model file is unreadable or corrupt
    │   └── PackageHashError         executable and metadata hashes disagree
    ├── DeviceError                  a simulated IPU failed or cannot be had
    │   ├── DeviceUnavailableError   no free device matched in the wait budget
    │   ├── DeviceRequestError       the request can never be met on this host
    │   ├── DeviceMemoryError        the model does not fit the device's memory
    │   └── DeviceFaultError         an (injected) application runtime error
    └── RuntimeUsageError            the runtime's or the Client's API misused
        ├── TensorError              unknown/missing tensor, wrong dtype/shape
        ├── ReplicaError             replica_id out of range
        ├── ClosedError              the runner / session / client is closed
        ├── ConcurrencyError         concurrent calls, runner not thread-safe
        └── RequestTimeoutError      a wait ran out (names the awaited tensor)

``TensorError`` and ``InvalidInputError`` both describe a bad tensor; the first
is raised by the in-process runtime, the second is what travels on the wire.
The worker translates one into the other.
"""

from __future__ import annotations

from typing import ClassVar


class IpuserveError(Exception):
    """Root of every ipuserve error."""

    code: ClassVar[str] = "INTERNAL"


class ConfigError(IpuserveError, ValueError):
    """A setting or constructor argument out of range; also a ValueError, which is what
    Python code passing a bad value expects to catch."""

    code = "BAD_CONFIG"


class ProtocolError(IpuserveError):
    code = "BAD_MESSAGE"


class UnsupportedVersionError(ProtocolError):
    code = "UNSUPPORTED_VERSION"


class RequestError(IpuserveError):
    code = "BAD_REQUEST"


class UnauthenticatedError(RequestError):
    """The gateway refused a call without a valid bearer token (docs/gateway.md), or the
    broker a message whose sender's CURVE key was removed from its allow-lists after it
    connected (docs/security.md)."""

    code = "UNAUTHENTICATED"


class PermissionDeniedError(RequestError):
    """The sender's role may not do this: a repository command from a key that is not
    an admin's (docs/security.md), or a key revoked since it connected."""

    code = "PERMISSION_DENIED"


class UnknownModelError(RequestError):
    code = "UNKNOWN_MODEL"

    @classmethod
    def nobody_serves(cls, model: str, models: str) -> UnknownModelError:
        """One wording wherever a model has no worker (broker and bench): the usual
        cause is a typo, or a worker never started, so say how to start one."""
        return cls(
            f"no worker serves model {model!r} (models: {models or 'none'}); check the "
            "name, or start a worker for it: `ipuserve worker --broker tcp://BROKER:5556 "
            f"--model FILE --name {model}`"
        )


class InvalidInputError(RequestError):
    code = "INVALID_INPUT"


class PayloadTooLargeError(RequestError):
    code = "PAYLOAD_TOO_LARGE"


class OverloadedError(RequestError):
    code = "OVERLOADED"


class DeadlineExceeded(RequestError, TimeoutError):
    """Also a ``TimeoutError``, like what ``Future.result(timeout)`` raises, so one
    ``except TimeoutError`` catches "too slow" whichever side noticed it."""

    code = "DEADLINE_EXCEEDED"


class ServingError(IpuserveError):
    code = "SERVING_FAILED"


class WorkerFailedError(ServingError):
    code = "WORKER_FAILED"


class InferenceError(ServingError):
    code = "INFERENCE_FAILED"


class UnavailableError(ServingError):
    code = "UNAVAILABLE"


class NoRoomError(UnavailableError):
    """A load no worker has the free IPUs (or the repository entry) for."""

    code = "NO_ROOM"


class BrokerShutdownError(UnavailableError):
    """The broker is stopping and let go of the request. The ``Client`` keeps such a
    request pending and re-sends it when a broker answers again (a restart), failing
    it only at its own deadline."""

    code = "BROKER_SHUTDOWN"


class HandshakeRefusedError(UnavailableError):
    """The broker refused the client's ZeroMQ handshake: a CURVE key it does not know or
    a wrong ``broker_public_key``, a keyless client at a broker with keys, or another
    host at a protected keyless broker. Raised by the client at once, never sent on the
    wire (a refused peer gets no answer); the message says which, and what to check."""

    code = "HANDSHAKE_REFUSED"


class ModelFileError(IpuserveError):
    code = "BAD_MODEL_FILE"


class PackageHashError(ModelFileError):
    code = "PACKAGE_HASH_MISMATCH"


class DeviceError(IpuserveError):
    code = "DEVICE_ERROR"


class DeviceUnavailableError(DeviceError):
    code = "DEVICE_UNAVAILABLE"


class DeviceRequestError(DeviceError):
    code = "DEVICE_REQUEST_IMPOSSIBLE"


class DeviceMemoryError(DeviceError):
    code = "DEVICE_OUT_OF_MEMORY"


class DeviceFaultError(DeviceError):
    code = "DEVICE_FAULT"


class RuntimeUsageError(IpuserveError):
    code = "RUNTIME_USAGE"


class TensorError(RuntimeUsageError):
    code = "INVALID_INPUT"


class ReplicaError(RuntimeUsageError):
    code = "INVALID_REPLICA"


class ClosedError(RuntimeUsageError):
    code = "CLOSED"


class ConcurrencyError(RuntimeUsageError):
    code = "CONCURRENT_USE"


class RequestTimeoutError(RuntimeUsageError, TimeoutError):
    code = "TIMEOUT"


def _all_subclasses(cls: type[IpuserveError]) -> list[type[IpuserveError]]:
    found: list[type[IpuserveError]] = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


#: Wire code -> exception class. Where two classes share a code (TensorError and
#: InvalidInputError) the wire-facing RequestError subclass wins.
def _by_code() -> dict[str, type[IpuserveError]]:
    table: dict[str, type[IpuserveError]] = {}
    classes: list[type[IpuserveError]] = [IpuserveError, *_all_subclasses(IpuserveError)]
    for cls in classes:
        if cls.code not in table or issubclass(cls, RequestError):
            table[cls.code] = cls
    return table


ERRORS_BY_CODE: dict[str, type[IpuserveError]] = _by_code()


def error_for_code(code: str, message: str) -> IpuserveError:
    """Rebuild the exception a peer reported; unknown codes become IpuserveError."""
    cls = ERRORS_BY_CODE.get(code, IpuserveError)
    return cls(message)
