"""Load generators: closed loop (N in flight) and open loop (a fixed arrival rate).

Both drive a :data:`Submit` — "start one request and call me back when it is done"
— so the same generators measure the ipuserve client and anything else.

*Closed loop* keeps ``in_flight`` requests outstanding: each completion starts
the next request from inside the completion callback. With the ipuserve client
that callback runs on the client's I/O thread, whose ``infer_async`` sends
directly, so the chain costs no thread hop.

*Open loop* issues requests at scheduled times (Poisson or evenly spaced)
regardless of completions, from its own thread, and measures latency from the
*scheduled* time, so a late generator cannot hide queueing (no coordinated
omission). ``max_in_flight`` bounds memory when the target cannot keep up;
arrivals over it are counted as skipped.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ipuserve.bench.recording import WINDOW_OPEN_NS, Recording, Sample
from ipuserve.client.timing import Timing

log = logging.getLogger(__name__)

#: After Ctrl-C, how long requests in flight may still finish: with the broker gone
#: each would otherwise hold the report back until its own timeout (30 s by default).
INTERRUPTED_DRAIN_S = 2.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a target reports for one finished request."""

    error: str | None = None
    timing: Timing | None = None
    samples: int = 1
    nbytes: int = 0
    #: the error's message, kept (the first of each code) for the summary
    message: str | None = None


OnDone = Callable[[Outcome], None]
Submit = Callable[[OnDone], None]
OnProgress = Callable[[Recording, int], None]


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """How long and how hard to push. Stops at ``duration_s`` or ``requests``, first reached."""

    warmup_s: float = 1.0
    duration_s: float | None = 10.0
    requests: int | None = None
    in_flight: int = 1
    rate: float | None = None  # requests/s: open loop when set
    poisson: bool = True
    max_in_flight: int = 10_000
    seed: int = 0

    @property
    def mode(self) -> str:
        return "closed" if self.rate is None else "open"


class _Window:
    """Warm-up, then the measurement window; shared by both generators."""

    def __init__(self, config: LoadConfig, recording: Recording) -> None:
        self.config = config
        self.recording = recording
        self.begin_ns = time.perf_counter_ns()
        self.recording.start_ns = self.begin_ns + int(config.warmup_s * 1e9)
        self.recording.stop_ns = WINDOW_OPEN_NS
        self._measured = 0
        self._lock = threading.Lock()
        self.finished = threading.Event()

    def record(self, sample: Sample) -> None:
        self.recording.add(sample)
        if sample.done_ns < self.recording.start_ns:
            return
        with self._lock:
            self._measured += 1
            if self._stop_due(sample.done_ns):
                self.recording.stop_ns = min(self.recording.stop_ns, sample.done_ns)

    def _stop_due(self, now_ns: int) -> bool:
        limit = self.config.requests
        if limit is not None and self._measured >= limit:
            return True
        return self.time_up(now_ns)

    def time_up(self, now_ns: int) -> bool:
        if self.config.duration_s is None:
            return False
        return now_ns >= self.recording.start_ns + int(self.config.duration_s * 1e9)

    @property
    def stopped(self) -> bool:
        return self.recording.window_closed

    def interrupt(self) -> None:
        """Ctrl-C: the window closes now; what finished inside it still counts."""
        with self._lock:
            self.recording.interrupted = True
            if not self.stopped:
                self.recording.stop_ns = max(time.perf_counter_ns(), self.recording.start_ns)

    def close_by_time(self) -> None:
        """Used when the stop is decided by the clock rather than by a completion."""
        with self._lock:
            now = time.perf_counter_ns()
            if not self.stopped and self.time_up(now):
                self.recording.stop_ns = now


def _sample(outcome: Outcome, start_ns: int) -> Sample:
    now = time.perf_counter_ns()
    return Sample(
        now,
        now - start_ns,
        outcome.error,
        outcome.timing,
        outcome.samples,
        outcome.nbytes,
        outcome.message,
    )


class ClosedLoop:
    """``in_flight`` requests outstanding until the window closes, then drain."""

    def __init__(self, submit: Submit, config: LoadConfig, recording: Recording) -> None:
        self._submit = submit
        self._window = _Window(config, recording)
        self._outstanding = 0
        self._lock = threading.Lock()
        self._failure: BaseException | None = None

    def run(self, progress: OnProgress | None = None) -> Recording:
        _wait(self._window, progress, lambda: self._outstanding, start=self._launch_all)
        if self._failure is not None:
            raise self._failure
        return self._window.recording

    def _launch_all(self) -> None:
        """The first ``in_flight`` requests; a Ctrl-C among them ends the run as one
        during the run does (it once surfaced as a bare "interrupted", no report)."""
        for _ in range(self._window.config.in_flight):
            self._launch()

    def _launch(self) -> None:
        with self._lock:
            self._outstanding += 1
        start = time.perf_counter_ns()
        try:
            self._submit(lambda outcome: self._done(outcome, start))
        except Exception as exc:  # the target refused (closed): stop, report at run()
            self._failure = exc
            self._retire()

    def _done(self, outcome: Outcome, start_ns: int) -> None:
        self._window.record(_sample(outcome, start_ns))
        if not self._window.stopped and self._failure is None:
            self._window.close_by_time()
        if self._window.stopped or self._failure is not None:
            self._retire()
            return
        with self._lock:
            self._outstanding -= 1
        self._launch()

    def _retire(self) -> None:
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._window.finished.set()


def arrivals(config: LoadConfig, start_ns: int) -> Iterator[int]:
    """The open loop's schedule: when each request is due, in ns from ``start_ns`` on.

    Evenly spaced ``1/rate`` apart, or with ``poisson`` exponential gaps of mean
    ``1/rate`` drawn from ``seed``; the first is due at ``start_ns``. The times depend
    on the config alone (:class:`OpenLoop` sleeps until each one), so the schedule can
    be checked without a clock.
    """
    assert config.rate is not None and config.rate > 0, "open loop needs a rate"
    gap_ns = 1e9 / config.rate
    if config.poisson:
        return _poisson(start_ns, gap_ns, config.seed)
    return (start_ns + round(k * gap_ns) for k in itertools.count())


def _poisson(start_ns: int, mean_gap_ns: float, seed: int) -> Iterator[int]:
    rng = np.random.default_rng(seed)
    offset_ns = 0.0  # from start_ns: a float of start_ns itself would lose nanoseconds
    while True:
        yield start_ns + round(offset_ns)
        offset_ns += float(rng.exponential(mean_gap_ns))


class OpenLoop:
    """Requests at scheduled arrival times from a generator thread, completions aside."""

    def __init__(self, submit: Submit, config: LoadConfig, recording: Recording) -> None:
        assert config.rate is not None and config.rate > 0, "open loop needs a rate"
        self._submit = submit
        self._window = _Window(config, recording)
        self._outstanding = 0
        self._lock = threading.Lock()
        self._issuing = True

    def run(self, progress: OnProgress | None = None) -> Recording:
        issuer = threading.Thread(target=self._issue, name="ipuserve-openloop", daemon=True)
        issuer.start()
        _wait(self._window, progress, lambda: self._outstanding)
        issuer.join()
        return self._window.recording

    def _issue(self) -> None:
        for due in arrivals(self._window.config, time.perf_counter_ns()):
            if self._window.stopped:
                break
            now = time.perf_counter_ns()
            if now < due:
                time.sleep((due - now) / 1e9)
            self._window.close_by_time()
            if self._window.stopped:
                break
            self._issue_one(due)
        with self._lock:
            self._issuing = False
            if self._outstanding == 0:
                self._window.finished.set()

    def _issue_one(self, scheduled_ns: int) -> None:
        with self._lock:
            if self._outstanding >= self._window.config.max_in_flight:
                if scheduled_ns >= self._window.recording.start_ns:
                    self._window.recording.skipped += 1
                return
            self._outstanding += 1
        self._submit(lambda outcome: self._done(outcome, scheduled_ns))

    def _done(self, outcome: Outcome, scheduled_ns: int) -> None:
        self._window.record(_sample(outcome, scheduled_ns))
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0 and not self._issuing:
                self._window.finished.set()


def _wait(
    window: _Window,
    progress: OnProgress | None,
    outstanding: Callable[[], int],
    start: Callable[[], None] | None = None,
) -> None:
    """Run ``start`` (what the caller's thread sends first), then block until the
    generator drained, reporting progress about four times a second.

    Ctrl-C closes the window at once and still drains what is in flight, so the caller
    reports what was measured so far; a second Ctrl-C gives up on that too."""
    try:
        if start is not None:
            start()
        _drain(window, progress, outstanding)
    except KeyboardInterrupt:
        window.interrupt()
        if not _drain(window, progress, outstanding, limit_s=INTERRUPTED_DRAIN_S):
            log.warning(
                "stopped waiting for %d request(s) still in flight (Ctrl-C); they are "
                "not in the figures",
                outstanding(),
            )


def _drain(
    window: _Window,
    progress: OnProgress | None,
    outstanding: Callable[[], int],
    limit_s: float | None = None,
) -> bool:
    """Wait until every request finished (True), or ``limit_s`` passed (False)."""
    give_up = None if limit_s is None else time.monotonic() + limit_s
    while not window.finished.wait(0.25):
        window.close_by_time()
        if progress is not None:
            progress(window.recording, outstanding())
        if give_up is not None and time.monotonic() >= give_up:
            return False
    if progress is not None:
        progress(window.recording, 0)
    return True


def run_load(submit: Submit, config: LoadConfig, progress: OnProgress | None = None) -> Recording:
    """Run the generator ``config`` asks for and return what it recorded."""
    recording = Recording()
    gen = ClosedLoop if config.rate is None else OpenLoop
    return gen(submit, config, recording).run(progress)
