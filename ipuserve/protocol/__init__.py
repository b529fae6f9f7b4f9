"""The ipuserve wire protocol: every message, and the only code that packs or parses frames.

A message is one ZeroMQ multipart message (a ROUTER adds the peer's identity in front;
strip it before :func:`decode`): frame 0 the envelope (b"IPUS", a version byte, a
:class:`Command` byte, then the id: 0..64 bytes, the client's request id, or empty);
frame 1 the header, a UTF-8 JSON object of at most Limits.max_header_bytes, nested at
most MAX_HEADER_DEPTH deep, whose fields
depend on the command (docs/protocol.md); frames 2.. one raw frame per tensor the header
lists, C-ordered little-endian, exactly prod(shape) * itemsize bytes.

Each command's header is a ``msgspec.Struct`` whose fields carry their limits, so
msgspec validates it while parsing; :func:`decode` checks all of a message before
anything uses it and raises :class:`ProtocolError` (or :class:`UnsupportedVersionError`),
:class:`InvalidInputError` or :class:`PayloadTooLargeError`, saying what is wrong.
Tensors stay the received frames (forwarded by reference), read as read-only
``np.frombuffer`` views; ``encode`` returns arrays as frames without copying them. Send
with :func:`ipuserve.transport.send`: nothing here imports zmq.

The modules, by job (callers import the package, ``from ipuserve import protocol as
wire``; its ``__all__`` is the public API):

* ``envelope``  constants, Command, Limits, and building a message's frames
* ``fields``    the declared field types every header uses; msgspec's refusals as ours
* ``tensors``   dtype allow-list, TensorSpec, Tensors, frame checks
* ``schema``    ModelSpec, and whether tensors fit it (check_inputs, outputs_problem)
* ``failures``  Fail, its row, and the codes a worker may send (WORKER_CODES)
* ``client_messages``, ``worker_messages``, ``batches`` (JOBS, RESULTS, REQUESTS,
  REPLIES: rows that may be groups, docs/protocol.md §2): each message with its
  declared header, its encoder (``encode``) and its decoder (``from_wire``)
* ``control``   the model repository's: REPOSITORY (admin), HOST, LOAD, UNLOAD
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
from ipuserve.protocol.codec import Message, decode, error_frames, peek_id, peek_ids
from ipuserve.protocol.control import (
    Entry,
    Host,
    Hosted,
    Load,
    RepositoryCommand,
    RepositoryReply,
    Unload,
    VersionState,
)
from ipuserve.protocol.envelope import (
    DEFAULT_LIMITS,
    ENVELOPE_BYTES,
    HEADER_FRAMES,
    MAX_COUNT,
    MAX_HEADER_DEPTH,
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
from ipuserve.protocol.schema import ModelSpec, batch_problem, check_inputs, outputs_problem
from ipuserve.protocol.tensors import DTYPES, Frame, Tensors, TensorSpec
from ipuserve.protocol.worker_messages import Bye, Heartbeat, Hello, Reconnect, Refusals, Welcome

#: The public API, by kind: constants, messages and types, functions.
__all__ = ["DEFAULT_LIMITS", "DTYPES", "ENVELOPE_BYTES", "HEADER_FRAMES", "MAX_COUNT"]
__all__ += ["MAX_DURATION_MS", "MAX_HEADER_DEPTH", "MAX_ID_BYTES", "MAX_MESSAGE_CHARS"]
__all__ += ["MAX_NAME_CHARS"]
__all__ += ["MAX_TIMING_KEYS", "MAX_TIMING_VALUE", "PROTOCOL_TAG", "PROTOCOL_VERSION", "TAG"]
__all__ += ["WORKER_CODES"]
__all__ += ["Bye", "Command", "ErrorReply", "Fail", "Frame", "Heartbeat", "Hello", "Job", "Jobs"]
__all__ += ["Limits", "ListModels", "Message", "ModelInfo", "ModelSpec", "ModelsReply", "Ping"]
__all__ += ["Pong", "Reconnect", "Refusals", "Replies", "Reply", "Request", "Requests", "Result"]
__all__ += ["Results", "TensorSpec", "Tensors", "Welcome", "WorkerLoad"]
__all__ += ["Entry", "Host", "Hosted", "Load", "RepositoryCommand", "RepositoryReply"]
__all__ += ["Unload", "VersionState"]
__all__ += ["batch_problem", "check_inputs", "decode", "encode_batch", "envelope", "error_frames"]
__all__ += ["name_problem", "outputs_problem", "peek_id", "peek_ids", "split_batch"]
