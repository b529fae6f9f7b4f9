"""``InputQueue`` / ``OutputQueue``: pack user tensors into the compiled batch and back.

Each queue owns an :class:`~ipuserve.runtime.ring_buffer.SpscRingBuffer` of reusable
:class:`InputData` / :class:`OutputData` items. Items hold *references* to user
memory, never copies: an input must stay unchanged until it has been consumed, an
output buffer must stay alive until its write-complete callback has run.

Geometry. The batch dimension is ``batch_dim`` (0 unless the queue was built for
``ModelRunnerConfig.batching_dim``); the compiled batch is ``shape[batch_dim]`` (1
for a scalar) and one *sample* is one index along it. Items carry any whole number
of samples; an item's ``data`` is kept in the anchor's layout with its own sample
count in place of the batch.

Threads (docs/architecture.md §1.1-1.3):

* producer -- enqueue*/flush/reset, from one thread at a time (the ModelRunner
  holds the replica's lock so that every queue of a request advances together);
* consumer -- the stream callback from :meth:`device_callback`, on the device thread;
* any thread -- cancel, pendingSamples, disconnect.

Cancellation keeps positions: a cancelled item still occupies its samples (inputs
become zeros, outputs are discarded) and only its callbacks and user memory are
skipped. Dropping its samples instead would shift every later item against the
batch boundaries that flush() and the output side have already counted on.

The package holds one module per job: :mod:`.items` (the ring's items and the user
callbacks), :mod:`.layout` (sample geometry and checks on user data), :mod:`.base`
(what both queues share), :mod:`.input_queue` and :mod:`.output_queue`.
"""

from __future__ import annotations

from ipuserve.runtime.queues.base import IQueue, ReadTimeoutPolicy, StreamCallback
from ipuserve.runtime.queues.input_queue import InputQueue
from ipuserve.runtime.queues.items import (
    InputData,
    OutputData,
    ReadCompleteCallback,
    ReadStartCallback,
    WriteCompleteCallback,
)
from ipuserve.runtime.queues.output_queue import OutputQueue
from ipuserve.runtime.ring_buffer import InputRingBuffer, OutputRingBuffer

__all__ = [
    "IQueue",
    "InputData",
    "InputQueue",
    "InputRingBuffer",
    "OutputData",
    "OutputQueue",
    "OutputRingBuffer",
    "ReadCompleteCallback",
    "ReadStartCallback",
    "ReadTimeoutPolicy",
    "StreamCallback",
    "WriteCompleteCallback",
]
