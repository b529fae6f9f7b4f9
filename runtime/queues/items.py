"""The items a queue's ring reuses, and the user callbacks they carry.

Items hold *references* to user memory, never copies; :meth:`Item.clear` drops them
as soon as the device is done, so a queue never keeps a caller's array alive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from numpy.typing import NDArray

Array: TypeAlias = NDArray[Any]

#: Called just before an input item's first samples are copied towards the device.
ReadStartCallback: TypeAlias = Callable[[], None]
#: Called once an input item's last samples have been handed to the device.
ReadCompleteCallback: TypeAlias = ReadStartCallback
#: Called with the filled output array (the user's memory, or the queue's).
WriteCompleteCallback: TypeAlias = Callable[[Array], None]


class Item:
    """Fields shared by input and output items; the ring reuses item objects."""

    __slots__ = ("cancelled", "data", "data_size", "dummy", "enqueue_time", "tag")
    data: Array | None
    data_size: int
    dummy: bool
    cancelled: bool
    tag: object
    enqueue_time: float

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Back to an empty item, dropping every reference to user memory."""
        self.data = None
        self.data_size = 0
        self.dummy = False
        self.cancelled = False
        self.tag = None
        self.enqueue_time = 0.0

    def __repr__(self) -> str:
        shape = None if self.data is None else list(self.data.shape)
        return (
            f"{type(self).__name__}(data={shape}, data_size={self.data_size}, "
            f"dummy={self.dummy}, cancelled={self.cancelled}, tag={self.tag!r})"
        )


class InputData(Item):
    """An input queue item: ``data`` (None = zeros), its size and optional callbacks.

    ``dummy`` marks flush padding (its outputs are discarded); ``cancelled`` items
    are fed as zeros without touching ``data`` or calling back; ``enqueue_time`` is
    ``time.monotonic()`` at enqueue (batch timeouts count from it).
    """

    __slots__ = ("readCompleteCallback", "readStartCallback")
    readStartCallback: ReadStartCallback | None
    readCompleteCallback: ReadCompleteCallback | None

    def clear(self) -> None:
        super().clear()
        self.readStartCallback = None
        self.readCompleteCallback = None


class OutputData(Item):
    """An output queue item: where to write (None = the queue provides memory).

    A ``dummy`` item is a flush handler: it discards the rest of the current batch.
    """

    __slots__ = ("writeCompleteCallback",)
    writeCompleteCallback: WriteCompleteCallback | None

    def clear(self) -> None:
        super().clear()
        self.writeCompleteCallback = None
