"""`.npy` files on the command line (`ipuserve infer`, `bench`, `tools real-data`): inputs
in, outputs out, and their summaries.

Every failure names the file and the tensor it was meant for, because the user
of a command line has nothing else to go on: an unreadable or non-array file is
a :class:`~ipuserve.errors.TensorError` ``input 'NAME': cannot read FILE: why``.
Only plain arrays are accepted (``allow_pickle=False``): a ``.npy`` file is data,
and loading one must never run code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ipuserve.errors import ConfigError, TensorError

Array = np.ndarray[Any, Any]

NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class NpyInput:
    """One input tensor and the file it came from."""

    name: str
    path: Path
    array: Array


def parse_input_spec(spec: str) -> tuple[str, Path]:
    """``NAME=FILE.npy`` -> (NAME, FILE.npy); ConfigError for anything else."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"{spec!r} is not NAME=FILE.npy")
    return name, Path(path)


def read_inputs(specs: Iterable[tuple[str, Path]]) -> dict[str, NpyInput]:
    """Load every named file; TensorError naming the tensor and file on the first failure."""
    inputs: dict[str, NpyInput] = {}
    for name, path in specs:
        if name in inputs:
            raise TensorError(f"input {name!r} is given twice: {inputs[name].path} and {path}")
        inputs[name] = NpyInput(name, path, read_npy(name, path))
    return inputs


def read_npy(name: str, path: Path) -> Array:
    """One ``.npy`` file as an array (never unpickling anything)."""
    try:
        with open(path, "rb") as file:
            _check_magic(name, path, file.read(len(NPY_MAGIC)))
            file.seek(0)
            array: Array = np.lib.format.read_array(file, allow_pickle=False)
            return array
    except FileNotFoundError:
        raise TensorError(f"input {name!r}: cannot read {path}: no such file") from None
    except (OSError, ValueError, EOFError) as error:
        raise TensorError(f"input {name!r}: cannot read {path}: {_one_line(error)}") from None


def _check_magic(name: str, path: Path, head: bytes) -> None:
    """Refuse what is not a .npy file up front, with a reason a user can act on."""
    if head == NPY_MAGIC:
        return
    what = (
        "a zip archive (an .npz?), not a single array; save the tensor alone with numpy.save"
        if head.startswith(b"PK")
        else "not a .npy file (no NUMPY header)"
    )
    raise TensorError(f"input {name!r}: cannot read {path}: {what}")


def output_paths(names: Iterable[str], directory: Path) -> dict[str, Path]:
    """``DIR/NAME.npy`` per output, with characters unsafe in file names replaced by ``_``."""
    paths: dict[str, Path] = {}
    for name in names:
        path = directory / (re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".npy")
        clash = [other for other, taken in paths.items() if taken == path]
        if clash:
            raise ConfigError(f"outputs {clash[0]!r} and {name!r} would both be written to {path}")
        paths[name] = path
    return paths


def write_outputs(outputs: Mapping[str, Array], paths: Mapping[str, Path]) -> None:
    """Save each output as a plain ``.npy`` array (creating the directory if needed)."""
    for name, array in outputs.items():
        path = paths[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, np.asarray(array).view(np.ndarray), allow_pickle=False)


def summarize(array: Array) -> dict[str, Any]:
    """Shape, dtype and min/max/mean -- enough to see at a glance that a result is sane."""
    values = np.asarray(array)
    summary: dict[str, Any] = {"shape": list(values.shape), "dtype": str(values.dtype)}
    if values.size == 0:
        return {**summary, "min": None, "max": None, "mean": None}
    numeric = values.astype(np.float64)
    summary.update(min=float(numeric.min()), max=float(numeric.max()), mean=float(numeric.mean()))
    return summary


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
