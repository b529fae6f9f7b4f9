"""What the broker does with each client command: REQUEST(S), MODELS, PING.

Admission is here: a request's schema is checked once, a job is created for it and
handed to the job life (:class:`Lifecycle`); what is refused is answered through
:class:`Answers`. Every collaborator comes in explicitly, in the constructor."""

from __future__ import annotations

import logging
import time

from ipuserve import protocol as wire
from ipuserve.broker.answers import Answers
from ipuserve.broker.backlog import Backlog
from ipuserve.broker.dispatch import Dispatcher
from ipuserve.broker.jobs import JobTable
from ipuserve.broker.lifecycle import GRACE_DEFAULT, Lifecycle
from ipuserve.broker.metrics import BrokerMetrics
from ipuserve.broker.registry import Registry
from ipuserve.errors import InvalidInputError, IpuserveError, PayloadTooLargeError, ProtocolError
from ipuserve.grouping import GroupSizer, group_problem
from ipuserve.security import Role
from ipuserve.versions import Key, version_order

log = logging.getLogger(__name__)

#: Request layouts (model schema, tensor specs) remembered as checked.
LAYOUTS = 1024


class ClientHandlers:
    def __init__(
        self,
        epoch: str,
        grace_until: float,
        max_payload_bytes: int,
        *,
        registry: Registry,
        jobs: JobTable,
        dispatcher: Dispatcher,
        backlog: Backlog,
        metrics: BrokerMetrics,
        answers: Answers,
        life: Lifecycle,
        group_sizer: GroupSizer,
    ) -> None:
        self._max_payload_bytes = max_payload_bytes
        self._registry = registry
        self._specs = registry.specs
        self._defaults = registry.defaults
        self._jobs = jobs
        self._keys = jobs.keys
        self._queues = dispatcher.queues
        self._backlog = backlog
        self._metrics = metrics
        self._answers = answers
        self._life = life
        self._group_sizer = group_sizer
        self._layouts: dict[
            tuple[int, tuple[wire.TensorSpec, ...]], tuple[wire.ModelSpec, int]
        ] = {}
        self._epoch = epoch
        #: Until then, requests for models nobody serves yet are queued, not refused.
        self.grace_until: float | None = grace_until

    def handle(self, client: bytes, message: wire.Message, role: Role) -> None:
        """Raises IpuserveError for anything to refuse; the loop turns it into ERROR.
        ``role`` is the sender's now (``Broker.role_of``): what an admin-only command
        checks (REQUEST(S), PING and MODELS are open to clients and admins alike)."""
        if isinstance(message, wire.Request):
            self.on_request(client, message)
        elif isinstance(message, wire.Requests):
            self.on_requests(client, message)
        elif isinstance(message, wire.Ping):
            pong = wire.Pong(message.request_id, self._epoch, self._max_payload_bytes)
            self._send(client, pong)
        elif isinstance(message, wire.ListModels):
            self._send(client, wire.ModelsReply(message.request_id, self.models()))
        else:
            raise ProtocolError(f"{message.COMMAND.name} is not a client command")

    def on_requests(self, client: bytes, batch: wire.Requests) -> None:
        """Each request (or group) of a batch on its own: one refused does not refuse the
        others. A group is admitted as it came, as one job, or refused whole: the
        client formed it (``ipuserve.grouping``), and the broker never reshapes it."""
        for failed in batch.rejected:
            self._answers.refuse(client, failed.job_id, failed.exception(), "")
        for row in batch.requests:
            try:  # a row's failure, even a bug, is its own: never a whole batch's
                if row.group and self._any_pending(client, row):
                    self._partly_sent(client, row)
                    continue
                if row.group:
                    self._check_group_bytes(row)
                self.on_request(client, row, batched=True)
            except Exception as exc:
                self._refuse_failed(client, row, exc)

    def _refuse_failed(self, client: bytes, request: wire.Request, exc: Exception) -> None:
        if not isinstance(exc, IpuserveError):
            log.exception("failed to handle a request of a REQUESTS batch")
            exc = IpuserveError("internal broker error; see its log")
        self._refuse(client, request, exc)

    def _check_group_bytes(self, row: wire.Request) -> None:
        """A group job's frames hold every member's tensor: past the payload limit, no
        worker could be sent it (a client keeps its groups within the limit its PONG
        gave)."""
        nbytes = row.tensors.nbytes * row.tensors.members
        if nbytes > self._max_payload_bytes:
            raise PayloadTooLargeError(
                f"a group of {row.tensors.members} requests takes {nbytes} bytes together; "
                f"the broker's limit is {self._max_payload_bytes} for a group as for a "
                "request (send fewer requests per group)"
            )

    def _any_pending(self, client: bytes, row: wire.Request) -> bool:
        return any(self._jobs.pending(client, member) for member in row.group)

    def _partly_sent(self, client: bytes, row: wire.Request) -> None:
        """A group some of whose requests are pending already: a client re-sends
        requests one by one, never in a new group, so only a broken client sends this.
        The pending ones are re-sends (their one reply is on the way); the others are
        refused, not run apart from the group they came in."""
        error = InvalidInputError(
            "a group's requests must all be new: some of this group's requests are "
            "pending already (re-send requests one by one)"
        )
        for member in row.group:
            if self._jobs.pending(client, member):
                self._metrics.resent.inc()
            else:
                self._answers.refuse(client, member, error, row.model)

    def _refuse(self, client: bytes, request: wire.Request, error: IpuserveError) -> None:
        for request_id in request.request_ids:
            self._answers.refuse(client, request_id, error, request.model)

    def on_request(self, client: bytes, request: wire.Request, batched: bool = False) -> None:
        """Admit one request (or group): the one place its schema and a group's size are
        checked; the job carries its sample count from here on, and the model version it
        goes to (the one named, else the model's default now). Raises IpuserveError to
        refuse it (a group whole). A request for a model not known yet (the start-up
        grace) waits as it is, checked when the model registers."""
        model = request.model
        if (client, request.request_id) in self._keys:
            self._metrics.resent.inc()
            return  # a re-sent request still pending: its one reply is on the way
        now = time.monotonic()
        tensors = request.tensors
        asked = request.version
        key = self._defaults.get(model) if asked is None else (model, asked)
        spec = self._specs.get(key) if key is not None else None
        samples = 0
        if spec is not None:
            member_samples = self._admitted(spec, tensors.specs)
            members = tensors.members
            if members > 1:
                problem = group_problem(spec, members, member_samples)
                if problem is not None:
                    raise InvalidInputError(problem)
            samples = members * member_samples
            if key in self._registry.orphaned:
                orphaned = self._life.orphan_error(spec.key, now)
                if orphaned is not None:
                    raise orphaned
        elif self.grace_until is None or now >= self.grace_until:
            raise self._registry.unknown(model, asked)
        job = self._jobs.create(
            client,
            request.request_id,
            spec.key if spec is not None else (model, asked or GRACE_DEFAULT),
            tensors,
            now,
            request.timeout_ms,
            batched,
            request.group,
            samples,
            asked,
        )
        try:
            self._life.admit(job, now)
        except Exception:
            self._jobs.finish(job)
            raise
        # a made-up name queued in the start-up grace gets no label of its own (for ever)
        named = (model, spec.version) if spec is not None else ("", "")
        self._metrics.of(*named).requests.inc(len(job.request_ids))

    def _admitted(self, spec: wire.ModelSpec, given: tuple[wire.TensorSpec, ...]) -> int:
        """Check ``given`` against the model's inputs (raises InvalidInputError) and
        return the samples one member carries. Remembered by the model spec's identity
        and the specs' value (declared structs: hashed and compared in C), so the check
        and the count are made once per layout, not per request. Holding the model spec
        rules out a reused id."""
        known = self._layouts.get((id(spec), given))
        if known is not None and known[0] is spec:
            return known[1]
        wire.check_inputs(spec, given)
        samples = spec.samples(t.shape for t in given)
        if len(self._layouts) >= LAYOUTS:
            self._layouts.clear()
        self._layouts[(id(spec), given)] = (spec, samples)
        return samples

    def models(self) -> tuple[wire.ModelInfo, ...]:
        """Every model version the broker knows, each its own entry (``spec.version``
        tells them apart), by name and version."""
        queues = self._queues
        ordered = sorted(self._registry.specs.items(), key=lambda kv: _by_version(kv[0]))
        return tuple(
            wire.ModelInfo(
                spec,
                len(queues[key]) if key in queues else 0,
                tuple(
                    wire.WorkerLoad(w.worker_id, w.credit, len(w.in_flight), w.requests_in_flight)
                    for w in self._registry.serving.get(key, ())
                ),
                self._group_sizer.listed(spec),
            )
            for key, spec in ordered
        )

    def _send(self, client: bytes, message: wire.Message) -> None:
        self._backlog.to_client(client, message.encode())


def _by_version(key: Key) -> tuple[str, tuple[int, str]]:
    return key[0], version_order(key[1])
