"""The tensor model: the dtype allow-list, tensor specs with their byte counts, and
:class:`Tensors`, named tensors held as the frames that carry them.

Arrays travel without copies: :meth:`Tensors.of` keeps an array as its frame, and a
received frame is read as a read-only ``np.frombuffer`` view. This module does not
import zmq (a received ``zmq.Frame`` is read through its ``buffer``), so code that
only handles tensors and specs needs no ZeroMQ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from ipuserve.errors import InvalidInputError

if TYPE_CHECKING:
    import zmq

#: dtype name -> wire dtype (little-endian); the allow-list.
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}

#: Anything pyzmq can send: bytes, a received zmq.Frame, a numpy array, a memoryview.
Frame: TypeAlias = "bytes | zmq.Frame | np.ndarray[Any, Any] | memoryview"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's name, dtype name (from :data:`DTYPES`) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    #: prod(shape) * itemsize, computed once: every message checks every frame against it.
    nbytes: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        wire = DTYPES.get(self.dtype)
        itemsize = wire.itemsize if wire is not None else np.dtype(self.dtype).itemsize
        object.__setattr__(self, "nbytes", math.prod(self.shape) * itemsize)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    def __str__(self) -> str:
        """``x:float32[4, 8]``, as listings and messages show a tensor."""
        return f"{self.name}:{self.dtype}{list(self.shape)}"


@dataclass(frozen=True, slots=True)
class Tensors:
    """Named tensors on the wire: specs plus one frame each (arrays, or received frames).

    A group's tensors (``members`` > 1: several requests of one layout travelling as
    one job) still have one frame per spec, holding every member's tensor, member
    after member: ``members x spec.nbytes`` bytes, as if stacked on a new first axis.
    Nobody between the client and the backend touches a member on its own.
    ``specs`` and ``nbytes`` describe one member.
    """

    specs: tuple[TensorSpec, ...] = ()
    frames: tuple[Frame, ...] = ()
    members: int = 1

    @classmethod
    def of(cls, arrays: Mapping[str, Any]) -> Tensors:
        """Wrap arrays without copying (a non-contiguous or big-endian one is copied once)."""
        specs, frames = [], []
        for name, value in arrays.items():
            array, dtype = _wire_array(name, value)
            specs.append(_spec_of(name, dtype, array.shape))
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
            specs.append(_spec_of(name, dtype, member))
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

    def slice(self, start: int, stop: int) -> Tensors:
        """Members ``start`` to ``stop`` of a group, as views (one member: a single one)."""
        stacks = self._stacks()
        if stop - start == 1:
            return Tensors(self.specs, tuple(stack[start] for stack in stacks))
        return Tensors(self.specs, tuple(stack[start:stop] for stack in stacks), stop - start)

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

    def header(self) -> list[dict[str, Any]]:
        return [spec.to_json() for spec in self.specs]


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


#: (name, dtype, shape) -> the one TensorSpec for it: a sender (a worker's outputs, a
#: client's inputs) repeats the same specs, so equal specs are the same objects and
#: their JSON is found in _SPECS_JSON without building anything.
_SPECS: dict[tuple[str, str, tuple[int, ...]], TensorSpec] = {}
_SPECS_SIZE = 4096


def _intern(spec: TensorSpec) -> TensorSpec:
    if len(_SPECS) >= _SPECS_SIZE:
        _SPECS.clear()
    return _SPECS.setdefault((spec.name, spec.dtype, spec.shape), spec)


def _spec_of(name: str, dtype: str, shape: tuple[int, ...]) -> TensorSpec:
    spec = _SPECS.get((name, dtype, shape))
    return spec if spec is not None else _intern(TensorSpec(name, dtype, tuple(shape)))


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
