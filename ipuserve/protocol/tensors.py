"""The tensor model: the dtype allow-list, tensor specs (declared, as they travel),
the checks of received specs and frames, and :class:`Tensors`, named tensors held as
the frames that carry them: arrays are sent without copies and received frames read
as read-only ``np.frombuffer`` views. No zmq: a ``zmq.Frame`` is read as a buffer."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

import msgspec
import numpy as np
from msgspec import Meta

from ipuserve.errors import InvalidInputError, PayloadTooLargeError, ProtocolError
from ipuserve.protocol.envelope import Command, Limits, nbytes
from ipuserve.protocol.fields import DTYPE_NAMES, Name, at_most

if TYPE_CHECKING:
    import zmq

#: dtype name -> wire dtype (little-endian); the allow-list.
DTYPES: dict[str, np.dtype[Any]] = {name: np.dtype(name).newbyteorder("<") for name in DTYPE_NAMES}

#: Anything pyzmq can send: bytes, a received zmq.Frame, a numpy array, a memoryview.
Frame: TypeAlias = "bytes | zmq.Frame | np.ndarray[Any, Any] | memoryview"


if TYPE_CHECKING:
    DType = str
else:  # declared for msgspec: a dtype off the allow-list is refused, its value named
    DType = Literal[tuple(DTYPES)]


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tensor's name, dtype name (from :data:`DTYPES`) and shape, as it travels; the
    bounds that depend on the receiver (rank, elements): :func:`checked_specs`."""

    name: Name
    dtype: DType
    shape: tuple[Annotated[int, Meta(ge=0)], ...]

    @property
    def nbytes(self) -> int:
        """prod(shape) * itemsize."""
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def __str__(self) -> str:
        """``x:float32[4, 8]``, as listings and messages show a tensor."""
        return f"{self.name}:{self.dtype}{list(self.shape)}"


Specs: TypeAlias = tuple[TensorSpec, ...]


def checked_specs(
    specs: Specs, limits: Limits, command: Command, field: str, index: int | None = None
) -> Specs:
    """``specs`` within a receiver's limits: count, unique names, rank, elements;
    ``command`` and ``field`` (formatted with ``index``, a spec table's) say where."""
    if len(specs) > limits.max_tensors:
        where = field if index is None else field.format(index)
        at_most(len(specs), limits.max_tensors, f"{command.name} header: {where}")
    if len(specs) > 1 and len({spec.name for spec in specs}) != len(specs):
        raise InvalidInputError(f"a tensor is named twice: {[spec.name for spec in specs]}")
    for spec in specs:
        shape, most = spec.shape, limits.max_elements
        elements = math.prod(shape)
        if len(shape) > limits.max_rank or elements > most or (not elements and max(shape) > most):
            raise InvalidInputError(_shape_problem(spec.name, list(shape), limits))
    return specs


def _shape_problem(name: str, shape: list[int], limits: Limits) -> str:
    if len(shape) > limits.max_rank:
        rank = f"at most {limits.max_rank} integers; got {shape}"[:120]
        return f"tensor {name!r} shape must be a list of {rank}"
    if any(dim > limits.max_elements for dim in shape):  # numpy cannot view it
        return f"tensor {name!r} shape {shape} has a dimension above {limits.max_elements}"
    return f"tensor {name!r} shape {shape} has more than {limits.max_elements} elements"


def received(
    specs: Specs, frames: Sequence[Frame], where: str, limits: Limits, members: int = 1
) -> Tensors:
    """The tensors of one request or job as received (a group's: each frame holds every
    member's): as many frames as specs, each of the right size; the payload limit holds
    per member."""
    if len(frames) != len(specs):
        raise ProtocolError(
            f"{where} lists {len(specs)} tensor(s) but {len(frames)} tensor frame(s) follow"
        )
    sizes = [math.prod(spec.shape) * DTYPES[spec.dtype].itemsize for spec in specs]
    if sum(sizes) > limits.max_payload_bytes:
        raise PayloadTooLargeError(
            f"the tensors take {sum(sizes)} bytes; the limit is {limits.max_payload_bytes}"
        )
    for spec, size, frame in zip(specs, sizes, frames, strict=True):
        if nbytes(frame) != size * members:
            each = f" for each of {members} members" if members > 1 else ""
            raise InvalidInputError(
                f"tensor {spec.name!r} ({spec.dtype}{list(spec.shape)}) needs {size} "
                f"bytes{each}; its frame has {nbytes(frame)}"
            )
    return Tensors(specs, tuple(frames), members)


@dataclass(frozen=True, slots=True)
class Tensors:
    """Named tensors on the wire: specs plus one frame each (arrays, or received frames).
    A group's tensors (``members`` > 1: several requests of one layout as one job) have
    one frame per spec too, holding every member's tensor, member after member, as if
    stacked on a new first axis; ``specs`` and ``nbytes`` describe one member."""

    specs: tuple[TensorSpec, ...] = ()
    frames: tuple[Frame, ...] = ()
    members: int = 1

    @classmethod
    def of(cls, arrays: Mapping[str, Any]) -> Tensors:
        """Wrap arrays without copying (a non-contiguous or big-endian one is copied once)."""
        specs, frames = [], []
        for name, value in arrays.items():
            array, dtype = _wire_array(name, value)
            specs.append(TensorSpec(name, dtype, array.shape))
            frames.append(array)
        return cls(tuple(specs), tuple(frames))

    @classmethod
    def group(cls, members: Sequence[Tensors]) -> Tensors:
        """One group of single ``members`` with the same specs (their bytes copied once)."""
        specs = members[0].specs
        if any(m.specs != specs or m.members != 1 for m in members):
            raise ValueError("a group's members must be single and share their specs")
        if len(members) == 1:
            return members[0]
        # every frame kind (bytes, arrays, zmq.Frame, memoryview) has the buffer protocol
        frames = tuple(
            b"".join([m.frames[i] for m in members])  # type: ignore[misc]
            for i in range(len(specs))
        )
        return cls(specs, frames, len(members))

    @classmethod
    def unstacked(cls, arrays: Mapping[str, Any], members: int, dim: int) -> Tensors:
        """A group of ``members`` from a group's outputs, each array cut along ``dim``
        into equal parts (the inverse of :meth:`stacked`; no copy when ``dim`` is 0)."""
        if members == 1:
            return cls.of(arrays)
        specs, frames = [], []
        for name, value in arrays.items():
            array, dtype = _wire_array(name, value)
            shape = array.shape
            if array.ndim <= dim or shape[dim] % members:
                raise InvalidInputError(
                    f"tensor {name!r} of shape {shape} does not split into {members} "
                    f"equal parts along dimension {dim}, one per member of the group"
                )
            member = (*shape[:dim], shape[dim] // members, *shape[dim + 1 :])
            if dim:  # members side by side inside each row: bring them to the front
                split = array.reshape(*shape[:dim], members, *member[dim:])
                array = np.ascontiguousarray(np.moveaxis(split, dim, 0))
            specs.append(TensorSpec(name, dtype, member))
            frames.append(array)
        return cls(tuple(specs), tuple(frames), members)

    def arrays(self) -> dict[str, np.ndarray[Any, Any]]:
        """Read-only views of the frames, keyed by name (of a single member)."""
        if self.members != 1:
            raise ValueError("a group's arrays: use split() or stacked()")
        return {
            spec.name: _view(spec, frame)
            for spec, frame in zip(self.specs, self.frames, strict=True)
        }

    def split(self) -> list[Tensors]:
        """Each member's tensors, in order, as views of the group's frames (read-only ones,
        for received frames)."""
        if self.members == 1:
            return [self]
        stacks = self._stacks()
        return [
            Tensors(self.specs, tuple(stack[i] for stack in stacks)) for i in range(self.members)
        ]

    def _stacks(self) -> list[np.ndarray[Any, Any]]:
        """Each frame as an array of shape ``(members, *spec.shape)``."""
        return [
            _view(spec, frame, self.members)
            for spec, frame in zip(self.specs, self.frames, strict=True)
        ]

    def stacked(self, dim: int) -> dict[str, np.ndarray[Any, Any]]:
        """The members' arrays joined along ``dim``, keyed by name: a group as one request
        (views of the frames when ``dim`` is 0, else one copy)."""
        if self.members == 1:
            return self.arrays()
        joined = {}
        for spec, frame in zip(self.specs, self.frames, strict=True):
            array = _view(spec, frame, self.members)  # (members, *spec.shape)
            if dim:
                array = np.concatenate(tuple(array), axis=dim)
            else:
                array = array.reshape(self.members * spec.shape[0], *spec.shape[1:])
            joined[spec.name] = array
        return joined

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)


#: dtype -> its wire name, for the dtypes sent as they are (allowed, little-endian):
#: a dict lookup, where ``dtype.name`` would run Python code on every call.
_WIRE_NAMES: dict[np.dtype[Any], str] = {
    dtype.newbyteorder("="): name for name, dtype in DTYPES.items() if dtype.isnative
}


def _wire_array(name: str, value: Any) -> tuple[np.ndarray[Any, Any], str]:
    """The array to send for ``value`` (itself when it can be) and its dtype's wire name."""
    array = value if type(value) is np.ndarray else np.asarray(value)
    dtype = _WIRE_NAMES.get(array.dtype)
    if dtype is not None and array.flags.c_contiguous:
        return array, dtype
    wire = DTYPES.get(array.dtype.name)
    if wire is None:
        raise InvalidInputError(
            f"tensor {name!r} has dtype {array.dtype}; allowed: {', '.join(DTYPES)}"
        )
    return np.ascontiguousarray(array, dtype=wire), array.dtype.name


def _view(spec: TensorSpec, frame: Frame, members: int = 1) -> np.ndarray[Any, Any]:
    """A frame as a read-only array of the spec's shape (a group's: ``(members, *shape)``)."""
    shape = spec.shape if members == 1 else (members, *spec.shape)
    if isinstance(frame, np.ndarray):
        return frame if frame.shape == shape else frame.reshape(shape)
    # a zmq.Frame is read through its buffer; bytes and memoryviews have no such
    # attribute (checked by name, so this module needs no zmq import)
    buffer: Any = getattr(frame, "buffer", frame)
    array = np.frombuffer(buffer, dtype=DTYPES[spec.dtype]).reshape(shape)
    array.flags.writeable = False
    return array
