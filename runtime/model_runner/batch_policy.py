"""Batch policies: how long a partial batch may wait for more samples (an ipuserve extension).

The spec's ModelRunnerConfig knows two ways to run a partial batch: after
``batch_size_timeout_ns`` from its first sample (a fixed window), or -- with that
timeout at 0 -- as soon as the device would otherwise idle (eager). Neither is
right at every load: in a closed loop of 16 one-sample clients on a batch of 16,
eager batching runs 8, meanwhile the other 8 come back, and the device settles into
alternating half batches at half its throughput; a fixed window fills the batches
there but makes a lone request wait out the window for nothing.

A :class:`BatchPolicy` answers one question for the replica, each time the thread
assembling a batch is about to wait, or the device finds no batch ready:
"this batch holds ``filled`` samples; how much longer may it wait?" --
``None`` (no limit of the policy's own: wait while the device is busy), ``0``
(run it now) or a number of seconds. :class:`AdaptivePolicy` answers from what it
measures (docs/architecture.md §1.5): samples handed back whose senders may send
again (``owed``), how long after their answer such samples came back, the
device time of a run and what a run costs the host; it needs no tuning.

``ModelRunner(model, config, batch_policy=factory)`` (the factory is called once
per replica) plugs a policy in, leaving ModelRunnerConfig as the spec has it;
without one the replica builds :func:`policy_from_spec`, which keeps the spec's
semantics. Policies are called from several threads (the caller's enqueue,
the reader assembling batches, the device thread); each guards its state itself.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from ipuserve.errors import ConfigError

#: ``on_batch(samples, waited_s)``: a batch closed (filled, or flushed partial) with
#: ``samples`` real samples, ``waited_s`` after its first sample arrived.
BatchObserver = Callable[[int, float], None]
#: ``ModelRunner(..., batch_policy=)``: replica index -> that replica's policy.
BatchPolicyFactory = Callable[[int], "BatchPolicy"]

POLICIES = ("eager", "fixed", "adaptive")
_EWMA = 0.2  # weight of a new measurement: about the last 5 runs / returns count
#: Answers remembered as owed at most: far more than ever come back within a run, and a
#: bound on memory where nobody asks (a device never idle never prunes the overdue).
MAX_OWED_ENTRIES = 1024


class BatchPolicy:
    """Base policy: never limits a wait (the spec's "batch timeout disabled").

    Subclasses override :meth:`hold_s`; the hooks let them measure the load. The
    ``on_batch`` observer, when given, is told of every batch the replica closes.
    """

    name = "none"
    #: True if the device thread must ask :meth:`hold_s` when it finds no batch ready
    #: (eager and adaptive decide there; a fixed window is timed by the reader alone).
    reacts_to_idle = False

    def __init__(self, limit_s: float | None = None, on_batch: BatchObserver | None = None):
        self.limit_s = limit_s
        self.on_batch = on_batch

    def hold_s(
        self, filled: int, batch: int, first_time: float, now: float, idle_since: float | None
    ) -> float | None:
        """How much longer a batch holding ``filled`` of ``batch`` samples, the first of
        which arrived at ``first_time``, may wait at ``now``; ``idle_since`` is when the
        device began waiting for a batch (None while it computes). Times are
        ``time.monotonic()`` seconds."""
        return None

    def arrived(self, samples: int, now: float) -> None:
        """``samples`` were enqueued at ``now``."""

    def completed(self, samples: int, now: float) -> None:
        """A request of ``samples`` had its outputs written at ``now``."""

    def ran(self, seconds: float) -> None:
        """The device computed one batch in ``seconds``."""

    def hosted(self, seconds: float) -> None:
        """One run cost the host ``seconds`` of CPU (the device thread's: the program's
        interpretation, the callbacks, and in the simulation the numpy work)."""

    def _within_limit(self, hold: float, first_time: float, now: float) -> float:
        if self.limit_s is None:
            return hold
        return min(hold, self.limit_s - (now - first_time))


class EagerPolicy(BatchPolicy):
    """Run a partial batch as soon as the device would otherwise wait (Triton's default)."""

    name = "eager"
    reacts_to_idle = True

    def hold_s(
        self, filled: int, batch: int, first_time: float, now: float, idle_since: float | None
    ) -> float | None:
        return None if idle_since is None else 0.0


class FixedPolicy(BatchPolicy):
    """Wait ``limit_s`` from the batch's first sample, busy device or not."""

    name = "fixed"

    def __init__(self, limit_s: float, on_batch: BatchObserver | None = None) -> None:
        super().__init__(limit_s, on_batch)

    def hold_s(
        self, filled: int, batch: int, first_time: float, now: float, idle_since: float | None
    ) -> float | None:
        return max(0.0, self._within_limit(float("inf"), first_time, now))


class AdaptivePolicy(BatchPolicy):
    """Wait only for samples that are on their way, and only when they come soon.

    While the device is busy a batch fills without cost, so the policy sets no limit.
    Once the device is idle, each sample waiting costs it time; the batch then waits
    only for samples the policy expects back: every answered sample is *owed* (its
    sender may send again), repaid by the next arrivals oldest first, which measure
    how long after its answer a sample returns (``return_s``, a mean plus two mean
    deviations, as TCP estimates its retransmission timeout). The batch waits until
    the owed sample that would complete it (or the last owed one) is due back -- if
    that is sooner than what a run costs (:attr:`cost_s`); a sample overdue is not
    waited for, and nothing owed means nothing is coming: the batch runs at once.

    What a run costs is its device time plus its host time: running now leaves the
    missing samples to a run of their own, which takes the device ``run_s`` and the
    host ``host_s`` (the device thread's CPU per run, measured); waiting idles the
    device for the wait. Weighing the device alone, the policy ran half batches at
    16 in flight on a two-core host whose answers came back in two runs' time, and
    reached 0.85 of a fixed 4 ms window there (docs/benchmarks.md): the host, not the
    device, was the limit, and each extra run cost it a millisecond of CPU.

    In a closed loop of N one-sample clients this fills the batch with the N (up to
    the batch size) instead of splitting them between runs; a lone client is owed
    nothing when its request arrives and never waits. The wait never exceeds one
    run's cost from when the batch could have started, nor ``limit_s``.
    """

    name = "adaptive"
    reacts_to_idle = True

    def __init__(self, limit_s: float | None = None, on_batch: BatchObserver | None = None):
        super().__init__(limit_s, on_batch)
        self._lock = threading.Lock()
        self._owed: deque[list[float]] = deque()  # [answered_at, samples] oldest first
        self._owed_samples = 0
        self._return_mean: float | None = None
        self._return_dev = 0.0
        self._run_s: float | None = None
        self._host_s = 0.0

    @property
    def run_s(self) -> float | None:
        """Device time per batch, as measured (None before the first run)."""
        return self._run_s

    @property
    def host_s(self) -> float:
        """Host CPU per run, as measured (0 before the first run, or if nobody says)."""
        return self._host_s

    @property
    def cost_s(self) -> float | None:
        """What a run costs: its device time and its host time (None before a run)."""
        run = self._run_s
        return None if run is None else run + self._host_s

    @property
    def return_s(self) -> float | None:
        """How long after its answer an owed sample is expected back (None: not yet seen)."""
        if self._return_mean is None:
            return None
        return self._return_mean + 2.0 * self._return_dev

    def ran(self, seconds: float) -> None:
        with self._lock:
            run = self._run_s
            self._run_s = seconds if run is None else run + _EWMA * (seconds - run)

    def hosted(self, seconds: float) -> None:
        with self._lock:
            host = self._host_s
            self._host_s = host + _EWMA * (seconds - host) if host else seconds

    def completed(self, samples: int, now: float) -> None:
        with self._lock:
            self._owed.append([now, float(samples)])
            self._owed_samples += samples
            if len(self._owed) > MAX_OWED_ENTRIES:
                self._owed_samples -= int(self._owed.popleft()[1])

    def arrived(self, samples: int, now: float) -> None:
        with self._lock:
            if self._owed:
                self._observe_return(now - self._owed[0][0])
            while samples > 0 and self._owed:
                oldest = self._owed[0]
                repaid = min(samples, int(oldest[1]))
                oldest[1] -= repaid
                samples -= repaid
                self._owed_samples -= repaid
                if oldest[1] <= 0:
                    self._owed.popleft()

    def hold_s(
        self, filled: int, batch: int, first_time: float, now: float, idle_since: float | None
    ) -> float | None:
        if idle_since is None:
            return None  # filling costs nothing while the device works
        with self._lock:
            cost_s = self.cost_s
            due = self._due(batch - filled, now, cost_s)
        if cost_s is None or due is None:
            return 0.0
        hold = min(due - now, cost_s - (now - max(first_time, idle_since)))
        return max(0.0, self._within_limit(hold, first_time, now))

    def _due(self, missing: int, now: float, cost_s: float | None) -> float | None:
        """When the owed sample that would complete the batch is due back; None if none
        is owed, or it is overdue, or it is further away than a run costs."""
        if cost_s is None:
            return None
        returns = self.return_s
        expected = cost_s if returns is None else returns
        while self._owed and self._owed[0][0] + expected < now:
            self._owed_samples -= int(self._owed.popleft()[1])  # overdue: not coming
        if not self._owed:
            return None
        counted, due = 0, now
        for answered_at, samples in self._owed:
            counted += int(samples)
            due = answered_at + expected
            if counted >= missing:
                break
        return due if due - now <= cost_s else None

    def _observe_return(self, seconds: float) -> None:
        mean = self._return_mean
        if mean is None:
            self._return_mean = seconds
            return
        self._return_dev += _EWMA * (abs(seconds - mean) - self._return_dev)
        self._return_mean = mean + _EWMA * (seconds - mean)


def make_policy(
    name: str, limit_s: float | None = None, on_batch: BatchObserver | None = None
) -> BatchPolicy:
    """The policy called ``name`` (one of :data:`POLICIES`); ``limit_s`` bounds any wait
    and is the window of ``fixed``, which needs one."""
    if name == "eager":
        return EagerPolicy(None, on_batch)
    if name == "fixed":
        if limit_s is None or limit_s <= 0:
            raise ConfigError("the fixed batch policy needs a batch timeout > 0 (its window)")
        return FixedPolicy(limit_s, on_batch)
    if name == "adaptive":
        return AdaptivePolicy(limit_s, on_batch)
    raise ConfigError(f"unknown batch policy {name!r}; expected one of {', '.join(POLICIES)}")


def policy_from_spec(enabled: bool, partial_timeout_ns: int, never_ns: int) -> BatchPolicy:
    """The spec's semantics as a policy: timeout 0 is eager, ``never_ns`` (or batch
    timeouts disabled) never limits a wait, anything else is a fixed window."""
    if not enabled or partial_timeout_ns == never_ns:
        return BatchPolicy()
    if partial_timeout_ns == 0:
        return EagerPolicy()
    return FixedPolicy(partial_timeout_ns / 1e9)


class BatchAccount:
    """Batches as the producer side forms them: real samples and when the first came.

    The replica feeds it under its lock, in step with the queues: every enqueue adds
    samples, every flush closes the partial batch. It knows, without reading the
    queues, how full the batch being assembled is and since when it has waited, and
    tells the policy's observer of each batch it closes.
    """

    def __init__(self, batch: int, on_batch: BatchObserver | None) -> None:
        self.batch = batch
        self.on_batch = on_batch
        self.filled = 0
        self.first_time = 0.0

    def add(self, samples: int, now: float) -> None:
        if self.filled == 0:
            self.first_time = now
        self.filled += samples
        while self.filled >= self.batch:
            self._close(self.batch, now)
            self.filled -= self.batch
            self.first_time = now

    def flushed(self, now: float) -> None:
        if self.filled:
            self._close(self.filled, now)
        self.filled = 0

    def reset(self) -> None:
        self.filled = 0

    def _close(self, samples: int, now: float) -> None:
        if self.on_batch is not None:
            self.on_batch(samples, now - self.first_time)
