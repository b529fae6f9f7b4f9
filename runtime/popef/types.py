"""The PopEF data model: what a model file describes, independent of how it is stored.

Names follow the real ``popef`` Python bindings (``Anchor.name()``,
``TensorInfo.numpyDType()``, ``Metadata.anchors()``, ...) so the spec's listings
run unchanged; the camelCase is deliberate API compatibility.

The simulated *executable* is a list of programs, each a tuple of :class:`Step`
objects: stream steps move an anchor's tensor across the host link, compute steps
run a numpy kernel from :mod:`ipuserve.runtime.popef.graph`, and ``switch`` picks
one branch from a selector tensor (conditional execution).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class DataType(enum.Enum):
    """Element types a tensor may have; the value is the numpy dtype name."""

    BOOL = "bool"
    S8 = "int8"
    U8 = "uint8"
    S16 = "int16"
    U16 = "uint16"
    S32 = "int32"
    U32 = "uint32"
    S64 = "int64"
    U64 = "uint64"
    F16 = "float16"
    F32 = "float32"
    F64 = "float64"

    @property
    def numpy(self) -> np.dtype[Any]:
        return np.dtype(self.value)

    @classmethod
    def from_numpy(cls, dtype: Any) -> DataType:
        """The DataType of a numpy dtype (or dtype name); ValueError if unsupported."""
        name = np.dtype(dtype).name
        for member in cls:
            if member.value == name:
                return member
        supported = ", ".join(m.value for m in cls)
        raise ValueError(f"unsupported dtype {name!r}; supported: {supported}")


class TensorInfo:
    """Shape and element type of a tensor."""

    __slots__ = ("_dtype", "_shape")

    def __init__(
        self, dtype: DataType | str | np.dtype[Any] = DataType.F32, shape: Sequence[int] = ()
    ) -> None:
        self._dtype = dtype if isinstance(dtype, DataType) else DataType.from_numpy(dtype)
        self._shape = [int(d) for d in shape]
        if any(d < 0 for d in self._shape):
            raise ValueError(f"negative dimension in shape {self._shape}")

    def shape(self) -> list[int]:
        return list(self._shape)

    def setShape(self, shape: Sequence[int]) -> None:
        self._shape = [int(d) for d in shape]

    def dataType(self) -> DataType:
        return self._dtype

    def setDataType(self, dtype: DataType) -> None:
        self._dtype = dtype

    def numpyDType(self) -> np.dtype[Any]:
        return self._dtype.numpy

    def numElements(self) -> int:
        return math.prod(self._shape)

    def sizeInBytes(self) -> int:
        return self.numElements() * self._dtype.numpy.itemsize

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorInfo)
            and other._dtype == self._dtype
            and other._shape == self._shape
        )

    def __hash__(self) -> int:
        return hash((self._dtype, tuple(self._shape)))

    def __repr__(self) -> str:
        return f"TensorInfo({self._dtype.name}, {self._shape})"


class TensorType(enum.Enum):
    """Direction of an anchor, seen from the IPU."""

    INPUT = "input"  # host -> device
    OUTPUT = "output"  # device -> host
    UNKNOWN = "unknown"


class Anchor:
    """A tensor the executable exchanges with the host (a Poplar data stream)."""

    def __init__(
        self,
        name: str = "",
        handle: str | None = None,
        tensor_info: TensorInfo | None = None,
        programs: Iterable[int] = (),
        tensor_type: TensorType = TensorType.UNKNOWN,
        is_per_replica: bool = False,
        use_remote_buffers: bool = False,
    ) -> None:
        self._name = name
        self._handle = name if handle is None else handle
        self._info = tensor_info if tensor_info is not None else TensorInfo()
        self._programs = sorted(set(int(p) for p in programs))
        self._type = tensor_type
        self._per_replica = is_per_replica
        self._remote = use_remote_buffers

    def name(self) -> str:
        return self._name

    def handle(self) -> str:
        return self._handle

    def tensorInfo(self) -> TensorInfo:
        return self._info

    def programs(self) -> list[int]:
        """Indices of the programs that read or write this anchor."""
        return list(self._programs)

    def type(self) -> TensorType:
        return self._type

    def isPerReplica(self) -> bool:
        return self._per_replica

    def useRemoteBuffers(self) -> bool:
        return self._remote

    def __repr__(self) -> str:
        return (
            f"Anchor({self._name!r}, {self._type.name}, {self._info.dataType().name}"
            f"{self._info.shape()}, programs={self._programs})"
        )


class ProgramFlow:
    """Which program indices make up the load, main and save phases."""

    def __init__(
        self, load: Sequence[int] = (), main: Sequence[int] = (), save: Sequence[int] = ()
    ) -> None:
        self._load = [int(p) for p in load]
        self._main = [int(p) for p in main]
        self._save = [int(p) for p in save]

    def load(self) -> list[int]:
        return list(self._load)

    def main(self) -> list[int]:
        return list(self._main)

    def save(self) -> list[int]:
        return list(self._save)

    def __repr__(self) -> str:
        return f"ProgramFlow(load={self._load}, main={self._main}, save={self._save})"


@dataclass(frozen=True)
class Step:
    """One instruction of a simulated program.

    ``op`` is ``"stream_in"`` (read the anchor named ``anchor`` into ``output``),
    ``"stream_out"`` (write ``inputs[0]`` to the host as ``anchor``), ``"switch"``
    (run ``branches[int(selector)]`` where the selector is ``inputs[0]``), or the
    name of a compute kernel in :mod:`ipuserve.runtime.popef.graph`.
    ``flops`` and ``host_bytes`` are this step's cost, fixed when the model was
    built; the device turns them into simulated time.
    """

    op: str
    inputs: tuple[str, ...] = ()
    output: str | None = None
    anchor: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)
    flops: int = 0
    host_bytes: int = 0
    branches: tuple[tuple[Step, ...], ...] = ()


@dataclass(frozen=True)
class Program:
    index: int
    name: str
    steps: tuple[Step, ...]


class Metadata:
    """Everything about a model except its executable and tensor data."""

    def __init__(
        self,
        *,
        model_name: str,
        executable: str,
        anchors: Sequence[Anchor],
        program_flow: ProgramFlow,
        num_ipus: int = 1,
        ipu_version: int = 2,
        replication_factor: int = 1,
        batch_size: int = 1,
        executable_hash: str = "",
        is_inference: bool = True,
    ) -> None:
        self._model_name = model_name
        self._executable = executable
        self._anchors = list(anchors)
        self._flow = program_flow
        self._num_ipus = num_ipus
        self._ipu_version = ipu_version
        self._replication_factor = replication_factor
        self._batch_size = batch_size
        self._executable_hash = executable_hash
        self._is_inference = is_inference

    def anchors(self) -> list[Anchor]:
        return list(self._anchors)

    def programFlow(self) -> ProgramFlow:
        return self._flow

    def numIpus(self) -> int:
        return self._num_ipus

    def ipuVersion(self) -> int:
        return self._ipu_version

    def replicationFactor(self) -> int:
        return self._replication_factor

    def executable(self) -> str:
        """Name of the executable this metadata belongs to."""
        return self._executable

    def isInference(self) -> bool:
        return self._is_inference

    # ipuserve extensions -------------------------------------------------
    def modelName(self) -> str:
        return self._model_name

    def batchSize(self) -> int:
        """The batch size the executable was compiled for (dimension 0 of its I/O)."""
        return self._batch_size

    def executableHash(self) -> str:
        """sha256 the executable must have (checked when check_package_hash is on)."""
        return self._executable_hash

    def anchor(self, name: str) -> Anchor:
        for anchor in self._anchors:
            if anchor.name() == name:
                return anchor
        raise KeyError(name)

    def __repr__(self) -> str:
        return (
            f"Metadata({self._model_name!r}, executable={self._executable!r}, "
            f"{len(self._anchors)} anchors, {self._flow!r})"
        )


class Executable:
    """The simulated Poplar executable: programs of :class:`Step` plus what they need.

    ``state_tensors`` are device-memory tensors that persist between program runs
    (weights written by a load program, counters); everything else a step produces
    lives only for the duration of one run. ``zero_time`` marks executables whose
    runs take no simulated time at all (the ``noop`` model used to measure the
    serving fabric on its own).
    """

    def __init__(
        self,
        *,
        name: str,
        programs: Sequence[Program],
        state_tensors: Iterable[str] = (),
        memory_bytes: int = 0,
        zero_time: bool = False,
        content_hash: str = "",
    ) -> None:
        self._name = name
        self._programs = list(programs)
        self._state = frozenset(state_tensors)
        self._memory_bytes = memory_bytes
        self._zero_time = zero_time
        self._hash = content_hash
        for position, program in enumerate(self._programs):
            if program.index != position:
                raise ValueError(
                    f"program {program.name!r} has index {program.index}, expected {position}"
                )

    def name(self) -> str:
        return self._name

    def hash(self) -> str:
        """sha256 (hex) of the executable's canonical serialisation."""
        return self._hash

    def programs(self) -> list[Program]:
        return list(self._programs)

    def program(self, index: int) -> Program:
        if not 0 <= index < len(self._programs):
            raise IndexError(
                f"executable {self._name!r} has no program {index} (it has {len(self._programs)})"
            )
        return self._programs[index]

    def stateTensors(self) -> frozenset[str]:
        return self._state

    def memoryBytes(self) -> int:
        """Device memory the loaded executable needs (weights, state and activations)."""
        return self._memory_bytes

    def zeroTime(self) -> bool:
        return self._zero_time

    def __repr__(self) -> str:
        return f"Executable({self._name!r}, {len(self._programs)} programs, hash={self._hash[:12]})"


class TensorDataInfo:
    def __init__(self, name: str, tensor_info: TensorInfo) -> None:
        self._name = name
        self._info = tensor_info

    def name(self) -> str:
        return self._name

    def tensorInfo(self) -> TensorInfo:
        return self._info


class TensorData:
    """Values stored in a model file for an anchor (weights, constants)."""

    def __init__(self, name: str, array: np.ndarray[Any, Any]) -> None:
        self._array = array
        self.info = TensorDataInfo(name, TensorInfo(DataType.from_numpy(array.dtype), array.shape))

    def name(self) -> str:
        return self.info.name()

    def array(self) -> np.ndarray[Any, Any]:
        """The stored values (read-only)."""
        return self._array

    def __repr__(self) -> str:
        return f"TensorData({self.name()!r}, {self.info.tensorInfo()!r})"


@dataclass
class Model:
    """A model assembled from one or more files: what Session and ModelRunner load."""

    metadata: Metadata
    executable: Executable
    tensorData: dict[str, TensorData]
    paths: list[str] = field(default_factory=list)

    def popefContainsTensorData(self, anchor_name: str) -> bool:
        return anchor_name in self.tensorData
