"""QueueManager: one input or output queue per anchor that waits for user data (spec 10.2.3).

Created through ``Session.createQueueManager(...)``. At creation it makes a queue
for every anchor of the model that is used by a program and not yet connected to
a callback (tensor data, frozen inputs and explicit callbacks stay as they are),
and connects each queue's device-side callback to the session. A ring buffer holds
``multiplier * batch`` items, the multiplier coming from an int or a
``ring_size_multiplier_factory`` function of the anchor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ipuserve.errors import ConfigError, TensorError
from ipuserve.runtime.popef.types import Anchor, TensorType
from ipuserve.runtime.queues import (
    InputData,
    InputQueue,
    OutputData,
    OutputQueue,
    ReadTimeoutPolicy,
)
from ipuserve.runtime.ring_buffer import SpscRingBuffer

if TYPE_CHECKING:
    from ipuserve.runtime.session import CallbackHandle, CallbackInfo, Session

RingSizeMultiplierProdType = Callable[[Anchor], int]
TimeoutCallback = Callable[[SpscRingBuffer[InputData]], None]


class QueueManager:
    """Note (as in the spec): queues serve models with replication factor 1."""

    def __init__(
        self,
        session: Session,
        ring_size_multiplier: int | RingSizeMultiplierProdType = 2,
        *,
        batch_dim: int = 0,
        timeout_ns: int = 0,
        timeout_callback: TimeoutCallback | None = None,
        read_timeout_policy: ReadTimeoutPolicy | None = None,
    ) -> None:
        self.inputs: dict[str, InputQueue] = {}
        self.outputs: dict[str, OutputQueue] = {}
        multiplier = (
            ring_size_multiplier
            if callable(ring_size_multiplier)
            else _constant(ring_size_multiplier)
        )
        for anchor in session.model.metadata.anchors():
            if not anchor.programs() or session.isConnected(anchor.handle()):
                continue
            dim = batch_dim if len(anchor.tensorInfo().shape()) > batch_dim else 0
            slots = multiplier(anchor) * _batch(anchor, dim)
            if anchor.type() is TensorType.INPUT:
                ring = SpscRingBuffer(
                    slots, anchor.name(), timeout_callback, timeout_ns, factory=InputData
                )
                queue = InputQueue(ring, anchor.tensorInfo(), name=anchor.name(), batch_dim=dim)
                queue.setReadTimeoutPolicy(read_timeout_policy)
                self.inputs[anchor.name()] = queue
            elif anchor.type() is TensorType.OUTPUT:
                out_ring = SpscRingBuffer(slots, anchor.name(), factory=OutputData)
                self.outputs[anchor.name()] = OutputQueue(
                    out_ring, anchor.tensorInfo(), name=anchor.name(), batch_dim=dim
                )
        session.setUserInputHandler(self._input_factory, skip_connected=True)
        session.setUserOutputHandler(self._output_factory, skip_connected=True)

    def inputQueue(self, name: str) -> InputQueue:
        if name not in self.inputs:
            raise _no_queue(name, "input", list(self.inputs))
        return self.inputs[name]

    def outputQueue(self, name: str) -> OutputQueue:
        if name not in self.outputs:
            raise _no_queue(name, "output", list(self.outputs))
        return self.outputs[name]

    def flushAll(self) -> None:
        for input_queue in self.inputs.values():
            input_queue.flush()
        for output_queue in self.outputs.values():
            output_queue.flush()

    def disconnectAll(self) -> None:
        for queue in self._all():
            queue.disconnect()

    def resetAll(self) -> None:
        for queue in self._all():
            queue.reset()

    def _all(self) -> list[InputQueue | OutputQueue]:
        return [*self.inputs.values(), *self.outputs.values()]

    def _input_factory(self, info: CallbackInfo) -> CallbackHandle | None:
        queue = self.inputs.get(info.anchor.name())
        return queue.device_callback() if queue is not None else None

    def _output_factory(self, info: CallbackInfo) -> CallbackHandle | None:
        queue = self.outputs.get(info.anchor.name())
        return queue.device_callback() if queue is not None else None


def _constant(multiplier: int) -> RingSizeMultiplierProdType:
    if multiplier < 1:
        raise ConfigError(f"ring size multiplier must be >= 1, got {multiplier}")
    return lambda _anchor: multiplier


def _batch(anchor: Anchor, dim: int) -> int:
    shape = anchor.tensorInfo().shape()
    return shape[dim] if shape else 1


def _no_queue(name: str, role: str, known: list[str]) -> TensorError:
    listed = ", ".join(known) or "none"
    return TensorError(f"no {role} queue for tensor {name!r}; {role} queues: {listed}")
