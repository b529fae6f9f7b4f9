"""How much work to keep together as one unit: the requests of a client's group the
broker makes one job, and the jobs a worker merges into one runtime request.

A group (docs/protocol.md §2.3) costs the broker and the worker about as much as one
request, so under load the bigger the better -- until the group holds more device
work than one replica should do alone: a group is one job, it runs on one replica
of one worker while the others may idle. So a job holds at most one compiled batch
of samples (what the runtime would have run together anyway), or, for a model whose
device time is small, up to ``DEVICE_BUDGET_US`` of it: below that the fabric's own
cost per job (a few hundred microseconds of CPU in the broker and again in the
worker, measured with ``ipuserve bench``) is what limits throughput, not the device.

The device time comes from the workers' RESULTS (``device_us`` per job), as a moving
average per model; until a model has one, a job holds one batch. The worker merges
jobs by the same rule, from its own runs: merging beyond one batch only saves the
runtime's cost per request, and every merged job waits for the last of them.
"""

from __future__ import annotations

from ipuserve import protocol as wire

#: Device time a group job may hold beyond one compiled batch.
DEVICE_BUDGET_US = 1000.0
#: Weight of the newest observation in the moving average of device time per sample.
SMOOTHING = 0.2


class GroupSizer:
    def __init__(self) -> None:
        self._us_per_sample: dict[str, float] = {}

    def observe(self, model: str, device_us: float, samples: int) -> None:
        """A job of ``samples`` samples ran for ``device_us`` on a worker."""
        if samples <= 0 or device_us < 0:
            return
        now = device_us / samples
        before = self._us_per_sample.get(model)
        self._us_per_sample[model] = now if before is None else before + SMOOTHING * (now - before)

    def samples_per_job(self, spec: wire.ModelSpec) -> int:
        """The most samples one job (or merged request) should hold."""
        return self.members_per_job(spec, 1)

    def members_per_job(self, spec: wire.ModelSpec, member_samples: int) -> int:
        """The most requests of ``member_samples`` samples each one job should hold."""
        member_samples = max(1, member_samples)
        one_batch = max(1, spec.batch_size // member_samples)
        per_sample = self._us_per_sample.get(spec.name)
        if per_sample is None:
            return one_batch
        affordable = DEVICE_BUDGET_US / max(per_sample * member_samples, 1e-3)
        return max(one_batch, int(affordable))
