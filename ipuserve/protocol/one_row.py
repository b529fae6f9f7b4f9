"""The one-row JOBS and RESULTS, encoded without the batch encoder's generator and
spec table: at one request in flight every JOBS and RESULTS is one of these.

Each writes exactly what :func:`ipuserve.protocol.batches._encode_inputs` and
``_encode_outputs`` write for the same row (tests/test_protocol_fastpath.py compares
them); measured with cProfile, an encode of either takes about half the calls.
"""

from __future__ import annotations

from collections.abc import Mapping

from ipuserve.protocol.envelope import (
    _ENVELOPES,
    ENTRY_OVERHEAD,
    CacheBudget,
    Command,
    _json,
    _number,
    _specs_json,
)
from ipuserve.protocol.tensors import Frame, Tensors

_JOBS_ENVELOPE = _ENVELOPES[Command.JOBS]
_RESULTS_ENVELOPE = _ENVELOPES[Command.RESULTS]


def one_job(job_id: bytes, model: str, tensors: Tensors, budget: float | None) -> list[Frame]:
    """A JOBS of one job, its spec table entry (model and tensor specs) from a cache."""
    entry = _JOB_ENTRIES.get((model, _specs_json(tensors)))
    if entry is None:
        entry = _job_entry(model, tensors)
    if budget is None:
        number = "null"
    elif budget - budget == 0:  # finite
        number = repr(float(budget))
    else:
        number = _number(budget)  # raises, as the batch encoder does
    members = "" if tensors.members == 1 else f",{tensors.members}"
    body = f'{{"specs":[{entry}],"jobs":[["{job_id.hex()}",0,{number}{members}]]}}'
    return [_JOBS_ENVELOPE, body.encode("ascii"), *tensors.frames]


#: (model, tensor specs JSON) -> a JOBS spec table entry
_JOB_ENTRIES: dict[tuple[str, str], str] = {}
_JOB_ENTRIES_BUDGET = CacheBudget()


def _job_entry(model: str, tensors: Tensors) -> str:
    specs = _specs_json(tensors)
    entry = f'{{"model":{_json(model)},"tensors":{specs}}}'
    if _JOB_ENTRIES_BUDGET.admit(_JOB_ENTRIES, 2 * len(entry) + ENTRY_OVERHEAD):
        _JOB_ENTRIES[(model, specs)] = entry
    return entry


def one_result(
    job_id: bytes, tensors: Tensors, timing: Mapping[str, float], timing_json: str | None
) -> list[Frame]:
    """A RESULTS of one result; its timing as the JSON text it came in, where known."""
    members = "" if tensors.members == 1 else f",{tensors.members}"
    text = _json(dict(timing)) if timing_json is None else timing_json
    row = f'["{job_id.hex()}",0,{text}{members}]'
    body = f'{{"specs":[{_specs_json(tensors)}],"results":[{row}]}}'
    return [_RESULTS_ENVELOPE, body.encode("ascii"), *tensors.frames]
