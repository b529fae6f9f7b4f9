"""What the spec's ``popef_dump`` prints, for ``ipuserve model inspect``.

:func:`describe` gathers everything worth knowing about a model into plain data
(the ``--json`` output); :func:`render` lays that out as text. Costs come from the
simulator's cost model at ``time_scale`` 1, i.e. the simulated IPU's own time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ipuserve.errors import DeviceRequestError
from ipuserve.runtime.popef.types import Model, Program, Step
from ipuserve.runtime.simulator.cost import LAUNCH_SECONDS, CostModel, IpuSpec, ipu_spec


def describe(model: Model) -> dict[str, Any]:
    """The model as JSON-ready data: identity, anchors, tensor data, programs, memory."""
    meta, exe = model.metadata, model.executable
    spec = _spec_or_none(meta.ipuVersion())
    flow = meta.programFlow()
    return {
        "files": list(model.paths),
        "model": meta.modelName(),
        "executable": {
            "name": exe.name(),
            "hash": exe.hash(),
            "expected_hash": meta.executableHash(),
            "hash_matches": exe.hash() == meta.executableHash(),
            "zero_time": exe.zeroTime(),
        },
        "ipus": meta.numIpus(),
        "ipu_version": meta.ipuVersion(),
        "ipu_name": spec.name if spec else None,
        "batch_size": meta.batchSize(),
        "replication_factor": meta.replicationFactor(),
        "program_flow": {"load": flow.load(), "main": flow.main(), "save": flow.save()},
        "anchors": [_anchor_row(model, a.name()) for a in meta.anchors()],
        "tensor_data": [
            {
                "name": name,
                "dtype": data.info.tensorInfo().dataType().value,
                "shape": data.info.tensorInfo().shape(),
                "bytes": data.info.tensorInfo().sizeInBytes(),
            }
            for name, data in model.tensorData.items()
        ],
        "programs": [_program_row(model, p, spec) for p in exe.programs()],
        "memory": {
            "needed_bytes": exe.memoryBytes(),
            "ipu_bytes": spec.memory_bytes if spec else None,
            "device_bytes": spec.memory_bytes * meta.numIpus() if spec else None,
            "fits": exe.memoryBytes() <= spec.memory_bytes * meta.numIpus() if spec else None,
        },
    }


def _spec_or_none(version: int) -> IpuSpec | None:
    try:
        return ipu_spec(version)
    except DeviceRequestError:
        return None


def _anchor_row(model: Model, name: str) -> dict[str, Any]:
    anchor = model.metadata.anchor(name)
    info = anchor.tensorInfo()
    return {
        "name": name,
        "handle": anchor.handle(),
        "direction": anchor.type().value,
        "dtype": info.dataType().value,
        "shape": info.shape(),
        "bytes": info.sizeInBytes(),
        "programs": anchor.programs(),
        "tensor_data": model.popefContainsTensorData(name),
    }


def _program_row(model: Model, program: Program, spec: IpuSpec | None) -> dict[str, Any]:
    seconds: float | None = None
    if model.executable.zeroTime():
        seconds = 0.0
    elif spec is not None:
        seconds = CostModel(spec, model.metadata.numIpus(), 1.0).program_seconds(program)
    flow = model.metadata.programFlow()
    phases = [
        phase
        for phase, indices in (("load", flow.load()), ("main", flow.main()), ("save", flow.save()))
        if program.index in indices
    ]
    return {
        "index": program.index,
        "name": program.name,
        "phase": "/".join(phases) or "-",
        "steps": _count_steps(program.steps),
        "flops": _worst(program.steps, "flops"),
        "host_bytes": _worst(program.steps, "host_bytes"),
        "estimated_seconds": seconds,
        # the part no time scale changes (IPUSERVE_SIM_TIME_SCALE slows the steps only)
        "launch_seconds": LAUNCH_SECONDS if seconds else seconds,
    }


def _count_steps(steps: Sequence[Step]) -> int:
    return sum(1 + sum(_count_steps(b) for b in s.branches) for s in steps)


def _worst(steps: Sequence[Step], cost: str) -> int:
    """Total ``cost`` of a run; a switch counts its costliest branch (as the cost model)."""
    total = 0
    for step in steps:
        if step.branches:
            total += max(_worst(branch, cost) for branch in step.branches)
        else:
            total += int(getattr(step, cost))
    return total


# -- text -----------------------------------------------------------------------------


def render(d: dict[str, Any]) -> str:
    """The description as the text ``ipuserve model inspect`` prints."""
    exe = d["executable"]
    check = (
        "matches the metadata"
        if exe["hash_matches"]
        else f"MISMATCH: the metadata expects {exe['expected_hash']}"
    )
    flow = d["program_flow"]
    lines = [
        f"Model {d['model']}  ({', '.join(d['files']) or 'in memory'})",
        f"  executable    {exe['name']}  sha256 {exe['hash']} ({check})"
        + ("  [zero time]" if exe["zero_time"] else ""),
        f"  IPUs          {d['ipus']} x {d['ipu_name'] or 'unknown IPU'} "
        f"(version {d['ipu_version']})",
        f"  batch size    {d['batch_size']} (compiled), replication factor "
        f"{d['replication_factor']}",
        f"  program flow  load {flow['load']}  main {flow['main']}  save {flow['save']}",
        "",
        "Anchors",
        *_table(
            ["name", "handle", "direction", "dtype", "shape", "bytes", "programs", "tensor data"],
            [
                [
                    a["name"],
                    a["handle"],
                    a["direction"],
                    a["dtype"],
                    str(a["shape"]),
                    _bytes(a["bytes"]),
                    ",".join(map(str, a["programs"])) or "-",
                    "yes" if a["tensor_data"] else "no",
                ]
                for a in d["anchors"]
            ],
        ),
        "",
        "Tensor data",
        *(
            _table(
                ["name", "dtype", "shape", "bytes"],
                [
                    [t["name"], t["dtype"], str(t["shape"]), _bytes(t["bytes"])]
                    for t in d["tensor_data"]
                ],
            )
            if d["tensor_data"]
            else ["  (none)"]
        ),
        "",
        "Programs (a switch counts its costliest branch)",
        *_table(
            ["index", "name", "phase", "steps", "FLOPs", "host bytes", "est. time"],
            [
                [
                    str(p["index"]),
                    p["name"],
                    p["phase"],
                    str(p["steps"]),
                    f"{p['flops']:,}",
                    _bytes(p["host_bytes"]),
                    _seconds(p["estimated_seconds"]),
                ]
                for p in d["programs"]
            ],
        ),
        "",
        "Device memory",
        "  " + _memory_line(d),
    ]
    return "\n".join(lines)


def _memory_line(d: dict[str, Any]) -> str:
    memory = d["memory"]
    needed = _bytes(memory["needed_bytes"])
    if memory["ipu_bytes"] is None:
        return f"needs {needed}; IPU version {d['ipu_version']} is unknown"
    verdict = "fits" if memory["fits"] else "DOES NOT FIT"
    share = 100 * memory["needed_bytes"] / memory["device_bytes"]
    return (
        f"needs {needed} of {_bytes(memory['device_bytes'])} ({d['ipus']} x "
        f"{_bytes(memory['ipu_bytes'])} per IPU): {share:.1f}% -- {verdict}"
    )


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]
    return [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]


def _bytes(count: int) -> str:
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"


def _seconds(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"
