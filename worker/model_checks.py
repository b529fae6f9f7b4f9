"""What a worker checks about a model before serving it: the dimension to batch its
requests along, whether the host has the IPUs its replicas need, and whether every
request produces every output.

Each refuses up front, with a message naming the fix, what would otherwise go wrong
later and worse: batching along a dimension that does not hold the compiled batch
returns wrong answers silently; a replica the host cannot place fails blaming IPUs
"in use"; a model that streams some anchors in one branch only hangs every request.
"""

from __future__ import annotations

import logging

from ipuserve.errors import ConfigError, DeviceUnavailableError
from ipuserve.runtime import (
    IPUS_ENV,
    IoPlan,
    ModelRunnerConfig,
    SimulatorConfig,
    batch_dims,
    holders,
    popef,
)

log = logging.getLogger(__name__)


def choose_batching_dim(model: popef.Model, requested: int | None) -> int | None:
    """The dimension to batch requests along: ``requested`` (``--batching-dim``) if the
    model's execute inputs and outputs all hold the compiled batch size along it;
    without one, dimension 0 if they do there, else the only dimension where they do,
    else None -- no dynamic batching: each request carries exactly the compiled shapes.
    Batching along any other dimension would run wrong maths silently (samples packed
    into rows the model treats differently), so a wrong ``requested`` or a choice of
    several is a ConfigError."""
    batch = model.metadata.batchSize()
    plan = IoPlan(model, ModelRunnerConfig())
    tensors = [
        (anchor.name(), tuple(anchor.tensorInfo().shape()))
        for anchor in (*plan.execute_inputs, *plan.execute_outputs)
    ]
    shaped = [(name, shape) for name, shape in tensors if shape]
    if not shaped:  # scalars only: nothing to batch along
        return 0 if requested is None else requested
    dims = batch_dims((shape for _, shape in shaped), batch)
    name = model.metadata.modelName()
    if requested is not None:
        if requested in dims:
            return requested
        tensor, shape = next(
            (t, s) for t, s in shaped if len(s) <= requested or s[requested] != batch
        )
        holds = (
            f"has no dimension {requested}"
            if len(shape) <= requested
            else f"holds {shape[requested]} along dimension {requested}"
        )
        hint = "" if dims else "; leave --batching-dim out to serve it without dynamic batching"
        raise ConfigError(
            f"--batching-dim {requested} is not where model {name!r} holds its compiled "
            f"batch size {batch}: its tensor {tensor!r} of shape {list(shape)} {holds}; "
            f"{_where(dims, batch, shaped)}{hint}"
        )
    if 0 in dims:
        if len(dims) > 1:
            log.warning(
                "model %r: %s; batching requests along dimension 0 (the default): pass "
                "--batching-dim if the batch is held along another",
                name,
                _holding(dims, batch, shaped),
            )
        return 0
    if len(dims) == 1:
        log.info(
            "model %r holds its batch of %d along dimension %d of every input and output: "
            "batching requests along it (--batching-dim %d)",
            name,
            batch,
            dims[0],
            dims[0],
        )
        return dims[0]
    if not dims:
        log.warning(
            "model %r: %s; serving it without dynamic batching (every request must carry "
            "exactly the compiled shapes)",
            name,
            _holding(dims, batch, shaped),
        )
        return None
    raise ConfigError(
        f"cannot tell which dimension of model {name!r} holds its batch of {batch}: "
        f"{_where(dims, batch, shaped)}"
    )


def _where(dims: list[int], batch: int, shaped: list[tuple[str, tuple[int, ...]]]) -> str:
    """Which --batching-dim would work, for an error message: the fact, then the fix."""
    fact = _holding(dims, batch, shaped)
    if len(dims) == 1:
        return f"{fact}: pass --batching-dim {dims[0]}"
    if dims:
        return f"{fact}: pass --batching-dim with the one that holds the batch"
    return fact


def _holding(dims: list[int], batch: int, shaped: list[tuple[str, tuple[int, ...]]]) -> str:
    """Which dimensions hold the compiled batch in every input and output."""
    if len(dims) == 1:
        return f"dimension {dims[0]} holds {batch} in every input and output"
    if dims:
        listed = " and ".join(map(str, dims))
        return f"dimensions {listed} all hold {batch} in every input and output"
    each = "; ".join(
        f"{name} {list(shape)}: "
        + (", ".join(str(d) for d, n in enumerate(shape) if n == batch) or "none")
        for name, shape in shaped
    )
    return f"no dimension holds {batch} in every input and output (dimensions holding it: {each})"


def check_unconditional(model: popef.Model) -> None:
    """Refuse a model with conditional execution (spec 3.5): each request runs one of
    several branches and streams only that branch's anchors, so the outputs of the
    others never come. A worker answers a request with every output and feeds every
    input, so such a request would wait for ever and the unread inputs of the other
    branches would shift every later request's."""
    steps = [
        step
        for index in model.metadata.programFlow().main()
        for step in model.executable.program(index).steps
    ]
    branch_only = sorted(_branch_only(steps))
    if branch_only:
        raise ConfigError(
            f"model {model.metadata.modelName()!r} runs one of several branches per request "
            f"(conditional execution): {', '.join(branch_only)} are streamed by a branch only, "
            "so a request's other outputs never come. A worker answers every request with "
            "every output and cannot serve it; run it with a ModelRunner instead "
            "(validate_io_params=False, giving only the chosen branch's inputs)"
        )


def _branch_only(steps: list[popef.Step]) -> set[str]:
    """Anchors some branches of a switch stream and others do not, unless they are also
    streamed outside it (then every run streams them)."""
    always: set[str] = set()
    sometimes: set[str] = set()
    for step in steps:
        if step.op in ("stream_in", "stream_out") and step.anchor:
            always.add(step.anchor)
        if step.op == "switch" and step.branches:
            first, *others = [_streamed(branch) for branch in step.branches]
            sometimes |= first.union(*others) - first.intersection(*others)
    return sometimes - always


def _streamed(steps: tuple[popef.Step, ...]) -> set[str]:
    """The anchors these steps (and their branches) stream in or out."""
    found = set()
    for step in steps:
        if step.op in ("stream_in", "stream_out") and step.anchor:
            found.add(step.anchor)
        for branch in step.branches:
            found |= _streamed(branch)
    return found


def check_inventory(model: popef.Model, replicas: int) -> None:
    """Refuse up front what the simulated host can never hold: else the runner fails on
    the first replica it cannot place, blaming IPUs in use."""
    host = SimulatorConfig.from_env().num_ipus
    each = model.metadata.numIpus()
    if replicas * each <= host:
        return
    fits = host // each if each else 0
    fewer = f"use --replicas {fits} or fewer, or " if fits else ""
    raise ConfigError(
        f"{replicas} replicas of model {model.metadata.modelName()!r} need "
        f"{replicas * each} IPUs ({each} each), but this host's simulated inventory has "
        f"{host}: {fewer}give the worker more IPUs with --ipus (or {IPUS_ENV})"
    )


def advise_on_busy_ipus(
    model: popef.Model, replicas: int, error: DeviceUnavailableError
) -> DeviceUnavailableError:
    """The runtime's "no free device" plus what to do about it. Called once the runner
    has let go of what its first replicas took, so every IPU still held is another's."""
    host = SimulatorConfig.from_env()
    each = model.metadata.numIpus() or 1
    free = host.num_ipus - sum(1 for _ in holders(host.locks, host.num_ipus))
    fits = free // each
    fewer = f"run it with --replicas {fits}, " if 0 < fits < replicas else ""
    return DeviceUnavailableError(
        f"{error}. This worker needs {replicas * each} IPU(s) and {free} of the host's "
        f"{host.num_ipus} are free now (the ones this process held are let go): "
        f"{fewer}stop a process holding the others, or give the simulated host more "
        f"IPUs with --ipus (or {IPUS_ENV})"
    )
