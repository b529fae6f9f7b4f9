"""What the broker does with each client command: REQUEST(S), MODELS, PING."""

from __future__ import annotations

import logging
import time

from ipuserve import protocol as wire
from ipuserve.broker.scheduler import Scheduler
from ipuserve.errors import IpuserveError, ProtocolError

log = logging.getLogger(__name__)

#: Request layouts (model schema, tensor specs) remembered as checked.
LAYOUTS = 1024


class ClientHandlers:
    def __init__(
        self, scheduler: Scheduler, epoch: str, grace_until: float, max_payload_bytes: int
    ) -> None:
        self._scheduler = scheduler
        self._max_payload_bytes = max_payload_bytes
        self._registry = scheduler.registry
        self._specs = scheduler.registry.specs
        self._jobs = scheduler.jobs
        self._keys = scheduler.jobs.keys
        self._metrics = scheduler.metrics
        self._layouts: dict[
            tuple[int, tuple[wire.TensorSpec, ...]], tuple[wire.ModelSpec, int]
        ] = {}
        self._epoch = epoch
        #: Until then, requests for models nobody serves yet are queued, not refused.
        self.grace_until: float | None = grace_until

    def handle(self, client: bytes, message: wire.Message) -> None:
        """Raises IpuserveError for anything to refuse; the loop turns it into ERROR."""
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
        others."""
        for failed in batch.rejected:
            self._scheduler.refuse(client, failed.job_id, failed.exception(), "")
        for row in batch.requests:
            try:  # a row's failure, even a bug, is its own: never a whole batch's
                requests = self._jobs_of(client, row)
            except Exception as exc:
                self._refuse_failed(client, row, exc)
                continue
            for request in requests:
                try:
                    self.on_request(client, request, batched=True)
                except Exception as exc:
                    self._refuse_failed(client, request, exc)

    def _refuse_failed(self, client: bytes, request: wire.Request, exc: Exception) -> None:
        if not isinstance(exc, IpuserveError):
            log.exception("failed to handle a request of a REQUESTS batch")
            exc = IpuserveError("internal broker error; see its log")
        self._refuse(client, request, exc)

    def _jobs_of(self, client: bytes, row: wire.Request) -> list[wire.Request]:
        """A group stays together when its model takes groups and none of its requests
        is pending already (a re-send may group them differently), in jobs no bigger
        than :mod:`ipuserve.broker.grouping` allows; otherwise its requests go on one by
        one, each as if sent alone."""
        if not row.group:
            return [row]
        spec = self._registry.specs.get(row.model)
        if (
            spec is None
            or not spec.groupable
            or any(self._jobs.pending(client, member) for member in row.group)
        ):
            return row.members()
        sizer = self._scheduler.group_sizer
        size = sizer.members_per_job(spec, spec.samples(t.shape for t in row.tensors.specs))
        fits = self._max_payload_bytes // max(1, row.tensors.nbytes)  # frames within the limit
        return row.parts(max(1, min(size, fits)))

    def _refuse(self, client: bytes, request: wire.Request, error: IpuserveError) -> None:
        for request_id in request.request_ids:
            self._scheduler.refuse(client, request_id, error, request.model)

    def on_request(self, client: bytes, request: wire.Request, batched: bool = False) -> None:
        """Admit one request (or group): the one place its schema is checked; the job
        carries its sample count from here on. Raises IpuserveError to refuse it."""
        model = request.model
        if (client, request.request_id) in self._keys:
            self._metrics.resent.inc()
            return  # a re-sent request still pending: its one reply is on the way
        now = time.monotonic()
        tensors = request.tensors
        spec = self._specs.get(model)
        samples = 0
        if spec is not None:
            samples = tensors.members * self._admitted(spec, tensors.specs)
            if model in self._registry.orphaned:
                orphaned = self._scheduler.orphan_error(model, now)
                if orphaned is not None:
                    raise orphaned
        elif self.grace_until is None or now >= self.grace_until:
            raise self._registry.unknown(model)
        job = self._jobs.create(
            client,
            request.request_id,
            model,
            tensors,
            now,
            request.timeout_ms,
            batched,
            request.group,
            samples,
        )
        try:
            self._scheduler.place(job, now)
        except Exception:
            self._jobs.finish(job)
            raise
        # a made-up name queued in the start-up grace gets no label of its own (for ever)
        self._metrics.requests.inc(len(job.request_ids), model=model if spec is not None else "")

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
        queues = self._scheduler.dispatcher.queues
        return tuple(
            wire.ModelInfo(
                spec,
                len(queues[name]) if name in queues else 0,
                tuple(
                    wire.WorkerLoad(w.worker_id, w.credit, len(w.in_flight), w.requests_in_flight)
                    for w in self._registry.serving.get(name, ())
                ),
            )
            for name, spec in sorted(self._registry.specs.items())
        )

    def _send(self, client: bytes, message: wire.Message) -> None:
        self._scheduler.outbox.to_client(client, message.encode())
