"""The ipuserve wire protocol: every message, and the only code that packs or parses frames.

Every message is one ZeroMQ multipart message (a ROUTER adds the peer's routing
identity in front; strip it before :func:`decode`)::

    frame 0   envelope   b"IPUS", one version byte (PROTOCOL_VERSION), one command
                         byte (a :class:`Command`), then the id: 0..64 bytes, the
                         client's request id, or empty
    frame 1   header     a UTF-8 JSON object, at most Limits.max_header_bytes;
                         its exact fields depend on the command (docs/protocol.md)
    frame 2.. tensors    one raw frame per tensor the header lists, in order,
                         C-ordered little-endian, exactly prod(shape) * itemsize bytes

The header is declared per command as a ``msgspec.Struct`` whose fields carry
their limits (``msgspec.Meta``), so msgspec validates it while parsing. The batches
(JOBS and RESULTS between broker and worker, REQUESTS and REPLIES from and to a
client) carry many jobs, and a row may be a *group* of requests sharing its frames
(docs/protocol.md §2).

:func:`decode` validates all of it before anything uses it and raises
:class:`ProtocolError` (or :class:`UnsupportedVersionError`), :class:`InvalidInputError`
or :class:`PayloadTooLargeError` with a message that says what is wrong. Tensors are
kept as the received frames (forwarded by reference) and read as read-only
``np.frombuffer`` views; ``encode`` returns arrays as frames without copying them
(non-contiguous or big-endian arrays are made contiguous once). Send with
:func:`ipuserve.transport.send` (or ``send_multipart(frames, copy=False)``): pyzmq
copies only frames below its copy threshold.

The package's modules, by job (callers import from the package: ``from ipuserve
import protocol as wire``; its ``__all__`` is the public API). Nothing here imports
zmq: sending and receiving are :mod:`ipuserve.transport`.

* ``envelope``  constants, Command, Limits, and building a message's frames
* ``fields``    the declared field types (msgspec constraints) every header uses, and
                msgspec's refusals as ours
* ``tensors``   the tensor model: dtype allow-list, TensorSpec, Tensors, frame checks
* ``schema``    ModelSpec, and whether tensors fit it: check_inputs, outputs_problem,
                batch_problem
* ``failures``  Fail, its row, and the codes a worker may send (WORKER_CODES)
* ``client_messages``, ``worker_messages``, ``batches``
                the messages by family: each with its declared header, its one
                encoder (``encode``) and its one decoder (``from_wire``)
* ``codec``     decode(), and the ids of messages it cannot decode (peek_id(s))
"""

from __future__ import annotations

from ipuserve.limits import MAX_DURATION_MS, MAX_NAME_CHARS, name_problem
from ipuserve.protocol.batches import (
    Job,
    Jobs,
    Replies,
    Requests,
    Result,
    Results,
    encode_batch,
    split_batch,
)
from ipuserve.protocol.client_messages import (
    ErrorReply,
    ListModels,
    ModelInfo,
    ModelsReply,
    Ping,
    Pong,
    Reply,
    Request,
    WorkerLoad,
)
from ipuserve.protocol.codec import (
    Message,
    decode,
    error_frames,
    peek_id,
    peek_ids,
)
from ipuserve.protocol.envelope import (
    DEFAULT_LIMITS,
    ENVELOPE_BYTES,
    HEADER_FRAMES,
    MAX_COUNT,
    MAX_ID_BYTES,
    MAX_MESSAGE_CHARS,
    MAX_TIMING_KEYS,
    MAX_TIMING_VALUE,
    PROTOCOL_TAG,
    PROTOCOL_VERSION,
    TAG,
    Command,
    Limits,
    envelope,
)
from ipuserve.protocol.failures import WORKER_CODES, Fail
from ipuserve.protocol.schema import (
    ModelSpec,
    batch_problem,
    check_inputs,
    outputs_problem,
)
from ipuserve.protocol.tensors import (
    DTYPES,
    Frame,
    Tensors,
    TensorSpec,
)
from ipuserve.protocol.worker_messages import (
    Bye,
    Heartbeat,
    Hello,
    Reconnect,
    Refusals,
    Welcome,
)

#: The public API, by kind: constants, messages and types, functions.
__all__ = ["DEFAULT_LIMITS", "DTYPES", "ENVELOPE_BYTES", "HEADER_FRAMES", "MAX_COUNT"]
__all__ += ["MAX_DURATION_MS", "MAX_ID_BYTES", "MAX_MESSAGE_CHARS", "MAX_NAME_CHARS"]
__all__ += ["MAX_TIMING_KEYS", "MAX_TIMING_VALUE", "PROTOCOL_TAG", "PROTOCOL_VERSION", "TAG"]
__all__ += ["WORKER_CODES"]
__all__ += ["Bye", "Command", "ErrorReply", "Fail", "Frame", "Heartbeat", "Hello", "Job", "Jobs"]
__all__ += ["Limits", "ListModels", "Message", "ModelInfo", "ModelSpec", "ModelsReply", "Ping"]
__all__ += ["Pong", "Reconnect", "Refusals", "Replies", "Reply", "Request", "Requests", "Result"]
__all__ += ["Results", "TensorSpec", "Tensors", "Welcome", "WorkerLoad"]
__all__ += ["batch_problem", "check_inputs", "decode", "encode_batch", "envelope", "error_frames"]
__all__ += ["name_problem", "outputs_problem", "peek_id", "peek_ids", "split_batch"]
