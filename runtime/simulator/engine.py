"""An executable loaded on a simulated device: runs programs with real numbers, simulated time.

The engine is the "Poplar engine" of the simulation. It keeps the device-resident
state tensors (weights, counters) between runs and executes one program at a
time through the popef interpreter, calling the host's anchor callbacks for the
stream steps. Time: a run costs the launch plus each step's cost (see
:mod:`~ipuserve.runtime.simulator.cost`); the engine keeps a simulated deadline
and sleeps off whatever the numpy work and host waits did not use. The device
waits for the host like a real IPU does: time spent blocked in an input callback
pushes the deadline back instead of overlapping with it, and a run whose inputs
were not ready is launched when they are (the launch is a host sync: it follows
the data), so a run estimated at T takes T whether the device was idle or busy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ipuserve.errors import DeviceMemoryError, TensorError
from ipuserve.runtime.popef.graph import run_program
from ipuserve.runtime.popef.types import Anchor, Executable, Step
from ipuserve.runtime.simulator.cost import CostModel

AnchorCallback = Callable[[np.ndarray], "np.ndarray | None"]

_STREAMS = frozenset({"stream_in", "stream_out"})


#: A run that starts within this long of the previous run's simulated end follows it
#: back to back: the device does not lose the host's wake-up jitter (see SimClock.start).
BACK_TO_BACK_S = 0.002
#: The same for a device loop (the ModelRunner's), which runs the main program again as
#: soon as a run ends: only a thread stalled this long (a stopped process) starts afresh.
DEVICE_LOOP_CATCH_UP_S = 0.05


class SimClock:
    """The simulated device's notion of "when this run may finish"."""

    __slots__ = ("_awaits_inputs", "_now", "catch_up_s", "deadline", "started")

    def __init__(
        self, now: Callable[[], float] = time.perf_counter, catch_up_s: float = BACK_TO_BACK_S
    ) -> None:
        self._now = now
        self.catch_up_s = catch_up_s
        self.deadline = 0.0
        #: When the current run started on the simulated device (its launch began).
        self.started = 0.0
        self._awaits_inputs = False

    def start(self, launch_seconds: float) -> None:
        """A run starts: at the previous run's end if it follows it back to back, else now.

        The device thread wakes from its sleep after the deadline (the host's scheduler:
        late by milliseconds when the host's cores are busy), then hands the outputs
        over before starting the next run; a real IPU with its next inputs ready waits
        for neither. Counting from the previous deadline keeps that host-side delay out
        of the device's time (on a busy two-core host it made a 5 ms batch take
        5.5 ms). A device that idles for want of inputs waits in an input callback,
        where :meth:`waited_for_host` moves the deadline; a gap of more than
        ``catch_up_s`` before a run is the host not asking for one, and the run
        starts now.
        """
        now = self._now()
        back_to_back = 0.0 <= now - self.deadline < self.catch_up_s
        self.started = self.deadline if back_to_back else now
        self.deadline = self.started + launch_seconds
        self._awaits_inputs = True

    def advance(self, seconds: float) -> None:
        self.deadline += seconds

    def waited_for_host(self, ready_at: float | None = None) -> None:
        """The device stalled on the host: nothing it had computed can overlap that wait.

        ``ready_at`` is when the host had the inputs ready, where the host knows it
        (the ModelRunner's look-ahead does: 0.0 if they were ready before the device
        asked); else the wait ended now. A run whose first inputs came late starts
        when they come, launch included: the launch is the host sync that hands them
        over, so it cannot overlap the wait (it once did, and a lone run of the MLP
        scaled to 2 ms took 0.8-0.96 ms). Knowing when the data was ready also keeps
        a device thread that is merely late to take a ready set (the host's
        scheduler) from being charged as a device stall.
        """
        ready = self._now() if ready_at is None else ready_at
        if self._awaits_inputs:  # the run's first inputs: everything so far follows them
            self._awaits_inputs = False
            charged = self.deadline - self.started
            if ready + charged > self.deadline:
                self.started = ready
                self.deadline = ready + charged
        elif ready > self.deadline:
            self.deadline = ready

    def sleep_until_deadline(self) -> None:
        remaining = self.deadline - self._now()
        if remaining > 0:
            time.sleep(remaining)


class Engine:
    """One executable loaded on one device, with its device-resident memory."""

    def __init__(
        self,
        executable: Executable,
        anchors: list[Anchor],
        cost: CostModel,
        device_memory_bytes: int,
        device_name: str,
        *,
        device_loop: bool = False,
    ) -> None:
        needed = executable.memoryBytes()
        if needed > device_memory_bytes:
            raise DeviceMemoryError(
                f"executable {executable.name()!r} needs {needed / 2**20:.1f} MiB of device "
                f"memory but {device_name} has {device_memory_bytes / 2**20:.1f} MiB"
            )
        self.executable = executable
        self.memory: dict[str, np.ndarray] = {}
        self._anchors = {a.name(): a for a in anchors}  # steps name anchors; callbacks use handles
        self._geometry = {
            a.name(): (a.handle(), tuple(a.tensorInfo().shape()), a.tensorInfo().numpyDType())
            for a in anchors
        }
        self._zero_time = executable.zeroTime() or cost.time_scale == 0
        self._launch = 0.0 if self._zero_time else cost.launch_seconds()
        self._step_seconds = {} if self._zero_time else _step_costs(executable, cost)
        self._clock = SimClock(catch_up_s=DEVICE_LOOP_CATCH_UP_S if device_loop else BACK_TO_BACK_S)
        #: Wall seconds the last run held the device: from its simulated start (the
        #: previous run's simulated end when back to back, else its launch or the
        #: arrival of its inputs) to its end. At least the program's estimate when
        #: time is simulated; the batch policy's measure of device time.
        self.last_run_seconds = 0.0

    @property
    def simulates_time(self) -> bool:
        """False when runs take only as long as the numpy work (time scale 0, IPU Model)."""
        return not self._zero_time

    def run(
        self,
        program_index: int,
        callbacks: Mapping[str, AnchorCallback],
        fault_check: Callable[[], None] | None = None,
        inputs_ready_at: Callable[[], float | None] | None = None,
    ) -> None:
        """Run one program to completion on the calling (device) thread.

        ``fault_check`` is called once per run, before the first output reaches
        the host (or at the end of a run without outputs): a device fault must
        fail the run before any caller sees a result from it. ``inputs_ready_at``
        says, after an input callback, when the host had that input ready
        (None: when the callback returned); see :meth:`SimClock.waited_for_host`.
        """
        program = self.executable.program(program_index)
        clock = self._clock
        pending_check = [fault_check] if fault_check is not None else []
        clock.start(self._launch)
        step_seconds = self._step_seconds

        geometry = self._geometry

        def read_anchor(step: Step) -> np.ndarray:
            handle, shape, dtype = geometry[step.anchor or ""]
            offered = np.empty(shape, dtype=dtype)
            given = callbacks[handle](offered)
            clock.waited_for_host(None if inputs_ready_at is None else inputs_ready_at())
            clock.advance(step_seconds.get(id(step), 0.0))
            if given is None:
                return offered
            if given.shape == shape and given.dtype == dtype and given.flags.c_contiguous:
                return given  # the zero-copy hand-over
            return _checked(given, self._anchors[step.anchor or ""])

        def write_anchor(step: Step, value: np.ndarray) -> None:
            if pending_check:
                pending_check.pop()()
            clock.advance(step_seconds.get(id(step), 0.0))
            clock.sleep_until_deadline()  # the host sees the data once the transfer ends
            callbacks[geometry[step.anchor or ""][0]](value)

        def on_step(step: Step) -> None:
            if step.op not in _STREAMS:
                clock.advance(step_seconds.get(id(step), 0.0))

        run_program(
            self.executable,
            program,
            self.memory,
            read_anchor,
            write_anchor,
            None if self._zero_time else on_step,
        )
        if pending_check:
            pending_check.pop()()
        clock.sleep_until_deadline()
        self.last_run_seconds = time.perf_counter() - clock.started


def _checked(given: Any, anchor: Anchor) -> np.ndarray:
    """A callback handed its own array instead of filling ours: it must be the anchor's."""
    info = anchor.tensorInfo()
    if (
        not isinstance(given, np.ndarray)
        or given.dtype != info.numpyDType()
        or list(given.shape) != info.shape()
    ):
        shape = getattr(given, "shape", None)
        dtype = getattr(given, "dtype", type(given).__name__)
        raise TensorError(
            f"callback for anchor {anchor.name()!r} returned {dtype} {shape}; "
            f"expected {info.numpyDType()} {info.shape()} (or None after filling the buffer)"
        )
    # Right shape but strided (e.g. Fortran order): outputs must stay C-contiguous.
    return np.ascontiguousarray(given)


def _step_costs(executable: Executable, cost: CostModel) -> dict[int, float]:
    """Seconds per step, keyed by identity: computed once per load, looked up per run."""
    costs: dict[int, float] = {}

    def visit(steps: tuple[Step, ...]) -> None:
        for step in steps:
            costs[id(step)] = cost.step_seconds(step)
            for branch in step.branches:
                visit(branch)

    for program in executable.programs():
        visit(program.steps)
    return costs
