"""Frames a fake worker sends, built by hand (so that they can be anything): its model
spec, RESULTS, and the job ids a RESULTS that does not decode still names."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ipuserve import protocol as wire
from ipuserve.protocol import Command
from tests.fuzz.engine import frames_of, header_depth, spec_json


def model_spec(name: str) -> dict[str, Any]:
    inputs = [spec_json("x", 4), spec_json("y", 4)]
    return {
        "name": name,
        "inputs": inputs,
        "outputs": [spec_json("z", 4)],
        "batch_size": 4,
        "batching_dim": 0,
    }


def worker_timing() -> dict[str, Any]:
    return {"worker_queue_us": 1.0, "device_us": 2.0, "worker_us": 3.0}


def results_frames(results: list[tuple[bytes, Any, dict[str, Any]]]) -> list[bytes]:
    specs: list[list[dict[str, Any]]] = []
    rows, frames = [], []
    for job, z, timing in results:
        spec = [spec_json("z", z.shape[0], str(z.dtype), z.shape[1])]
        if spec not in specs:
            specs.append(spec)
        rows.append([job.hex(), specs.index(spec), timing])
        frames.append(np.ascontiguousarray(z).tobytes())
    return frames_of(Command.RESULTS, b"", {"specs": specs, "results": rows}, *frames)


def named_jobs(frames: list[bytes]) -> list[bytes]:
    """The job ids a RESULTS that does not decode still names in a readable header."""
    if len(frames) < 2 or frames[0] != wire.TAG + bytes([Command.RESULTS]):
        return []
    if len(frames[1]) > wire.DEFAULT_LIMITS.max_header_bytes:
        return []
    if header_depth(frames[1]) > wire.MAX_HEADER_DEPTH:
        return []  # refused unread: docs/protocol.md §3
    try:
        header = json.loads(frames[1])
    except (ValueError, RecursionError):
        return []
    found = [header.get(key) for key in ("results", "failures")] if isinstance(header, dict) else []
    rows = [
        row
        for value in found
        for row in (value if isinstance(value, list) else [])
        if isinstance(row, list) and row and isinstance(row[0], str)
    ]
    named = []
    for row in rows:
        try:
            named.append(bytes.fromhex(row[0]))
        except ValueError:
            pass
    return named
