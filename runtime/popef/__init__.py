"""PopEF stand-in: the model file format of the simulated runtime.

``from ipuserve.runtime import popef`` works like the real ``import popef``::

    reader = popef.Reader()
    reader.parseFile("simple.popef")
    model = popef.ModelBuilder(reader).createModel()
    for anchor in model.metadata.anchors():
        print(anchor.name(), anchor.tensorInfo().shape(), anchor.tensorInfo().numpyDType())

ipuserve additions: :class:`GraphBuilder` writes models, :func:`load_model` reads
one from several files, :func:`verify_package_hash` is ``check_package_hash``,
:func:`run_program` interprets a program, and :mod:`.examples` holds the example
models with numpy references. The file layout is in ``docs/model-format.md``.
"""

from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.builder import GraphBuilder, Switch
from ipuserve.runtime.popef.builder_ops import Tensor
from ipuserve.runtime.popef.container import (
    FORMAT_NAME,
    FORMAT_VERSION,
    read_container,
    write_container,
    write_model,
)
from ipuserve.runtime.popef.graph import OPS, TensorSpec, memory_bytes, run_program
from ipuserve.runtime.popef.reader import (
    ModelBuilder,
    Reader,
    load_model,
    source_of,
    verify_package_hash,
)
from ipuserve.runtime.popef.types import (
    Anchor,
    DataType,
    Executable,
    Metadata,
    Model,
    Program,
    ProgramFlow,
    Step,
    TensorData,
    TensorDataInfo,
    TensorInfo,
    TensorType,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "OPS",
    "Anchor",
    "DataType",
    "Executable",
    "GraphBuilder",
    "Metadata",
    "Model",
    "ModelBuilder",
    "Program",
    "ProgramFlow",
    "Reader",
    "Step",
    "Switch",
    "Tensor",
    "TensorData",
    "TensorDataInfo",
    "TensorInfo",
    "TensorSpec",
    "TensorType",
    "examples",
    "load_model",
    "memory_bytes",
    "read_container",
    "run_program",
    "source_of",
    "verify_package_hash",
    "write_container",
    "write_model",
]
