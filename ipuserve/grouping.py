"""Groups: which requests may share one job, and how much work one job should hold.

A group (docs/protocol.md §2.3) is several requests of one client for one model,
joined along the model's batching dimension, that travel, run and are answered as
one job: it costs the broker and the worker about as much as one request. It is
formed once, by the client, and carried as it is: the broker never cuts or
dissolves one, and the worker runs it as one runtime request.

Whether a group may exist at all is decided here, in :func:`group_problem`, which
the broker (at admission) and the worker (on a JOBS row) both ask: a model takes
groups when every tensor has its batching dimension (``ModelSpec.groupable``), and
a group job holds at most :func:`group_ceiling` samples. A group that fails is
refused INVALID_INPUT; a correct client never sends one, since it forms its groups
with :func:`members_per_group` from what the broker lists for the model
(``ModelInfo.spec`` and ``ModelInfo.group_samples``).

How big a job *should* be is :class:`GroupSizer`'s estimate, which the broker
lists as ``group_samples``: under load the bigger the better -- until the job holds
more device work than one replica should do alone (a job runs on one replica of one
worker while the others may idle). So a job holds one compiled batch of samples
(what the runtime would have run together anyway), or, for a model whose device
time is small, up to ``DEVICE_BUDGET_US`` of it: below that the fabric's own cost
per job (a few hundred microseconds of CPU in the broker and again in the worker,
measured with ``ipuserve bench``) is what limits throughput, not the device. The
device time comes from the workers' RESULTS (``device_us`` per job), as a moving
average per model. The estimate never passes the ceiling, so a client that formed
its groups from an older estimate still sends groups the broker takes as they are.
The worker keeps a sizer too, from its own runs, to size how far ahead it asks the
runtime to work (``runner_backend``).
"""

from __future__ import annotations

from ipuserve import protocol as wire

#: Device time a group job may hold beyond one compiled batch.
DEVICE_BUDGET_US = 1000.0
#: Weight of the newest observation in the moving average of device time per sample.
SMOOTHING = 0.2
#: The most samples a group job may hold, for a model whose compiled batch is smaller:
#: what the sizer may advise at most, and the broker's and worker's hard limit.
MAX_GROUP_SAMPLES = 4096


def group_ceiling(spec: wire.ModelSpec) -> int:
    """The most samples one group job of ``spec`` may hold; 0 if it takes no groups."""
    if not spec.groupable:
        return 0
    return max(spec.batch_size, MAX_GROUP_SAMPLES)


def group_problem(spec: wire.ModelSpec, members: int, member_samples: int) -> str | None:
    """Why a group of ``members`` requests of ``member_samples`` samples each cannot
    be one job of ``spec``, or None when it can (a single request always can)."""
    if members <= 1:
        return None
    ceiling = group_ceiling(spec)
    if not ceiling:
        return (
            f"model {spec.name!r} cannot take a group of requests: not every tensor has "
            f"its batching dimension ({spec.batching_dim})"
        )
    if members * member_samples > ceiling:
        return (
            f"a group of {members} requests of {member_samples} sample(s) each holds "
            f"{members * member_samples} samples; model {spec.name!r} takes at most "
            f"{ceiling} in one group (send fewer requests per group)"
        )
    return None


def members_per_group(spec: wire.ModelSpec, member_samples: int, job_samples: int) -> int:
    """The most requests of ``member_samples`` samples each a client should put in one
    group, given the broker's ``job_samples`` (its ``ModelInfo.group_samples``): at
    least 1, never a group :func:`group_problem` refuses, never more ids than a
    REQUESTS row may list."""
    member_samples = max(1, member_samples)
    limit = min(job_samples, group_ceiling(spec))
    return max(1, min(limit // member_samples, wire.DEFAULT_LIMITS.max_batch))


class GroupSizer:
    """How many samples a job should hold, per model, from the device time it took."""

    def __init__(self) -> None:
        self._us_per_sample: dict[str, float] = {}

    def observe(self, model: str, device_us: float, samples: int) -> None:
        """A job of ``samples`` samples ran for ``device_us`` on a worker."""
        if samples <= 0 or device_us < 0:
            return
        now = device_us / samples
        before = self._us_per_sample.get(model)
        self._us_per_sample[model] = now if before is None else before + SMOOTHING * (now - before)

    def listed(self, spec: wire.ModelSpec) -> int:
        """What the broker lists as the model's ``group_samples``: 0 when it takes no
        groups, else :meth:`samples_per_job`."""
        return self.samples_per_job(spec) if group_ceiling(spec) else 0

    def samples_per_job(self, spec: wire.ModelSpec) -> int:
        """The most samples one job should hold (for a model that takes groups, what
        the broker lists; and how far ahead a worker asks its runtime to work)."""
        return self.members_per_job(spec, 1)

    def members_per_job(self, spec: wire.ModelSpec, member_samples: int) -> int:
        """The most requests of ``member_samples`` samples each one job should hold:
        one compiled batch, or more while the device time is small, within
        ``MAX_GROUP_SAMPLES`` (or the compiled batch, when that is larger)."""
        member_samples = max(1, member_samples)
        one_batch = max(1, spec.batch_size // member_samples)
        per_sample = self._us_per_sample.get(spec.name)
        if per_sample is None:
            return one_batch
        affordable = DEVICE_BUDGET_US / max(per_sample * member_samples, 1e-3)
        most = max(1, max(spec.batch_size, MAX_GROUP_SAMPLES) // member_samples)
        return max(one_batch, min(int(affordable), most))
