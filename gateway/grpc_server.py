"""The gateway's gRPC front door: ``inference.GRPCInferenceService`` on grpcio's asyncio
server, in front of :class:`~ipuserve.gateway.service.InferenceService`.

The handlers are registered by hand under the protocol's full service name rather
than through a generated ``_pb2_grpc`` module, because our messages live in the
protobuf package ``ipuserve.oip`` (see gateway/proto/inference.proto for why): the
RPC paths, ``/inference.GRPCInferenceService/<Method>``, are the specification's, and
the message bytes are the same whatever the package is called. The same handlers
also answer under ``ipuserve.oip.GRPCInferenceService``, for clients generated from
our own .proto.

Per call: the ``authorization: Bearer ...`` metadata is checked (the health RPCs
ServerLive and ServerReady are open, as HTTP's ``/v2/health/*`` are, for probes);
ipuserve's errors become the gRPC status of the one table in
:mod:`ipuserve.gateway.status`, with the error's message as the details. A message
over the configured body limit is refused by gRPC itself with RESOURCE_EXHAUSTED; the
token is checked before a message is received, and its size before it is parsed
(:meth:`_Servicer._rpc`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from ipuserve.errors import (
    ConfigError,
    IpuserveError,
    PayloadTooLargeError,
    RequestError,
    UnknownModelError,
)
from ipuserve.gateway import grpc_convert as convert
from ipuserve.gateway.auth import Tokens, grpc_peer_host
from ipuserve.gateway.config import GatewayConfig
from ipuserve.gateway.grpc_precheck import precheck
from ipuserve.gateway.model_config import health, to_proto, triton_config
from ipuserve.gateway.offload import off_loop
from ipuserve.gateway.proto import inference_pb2 as pb
from ipuserve.gateway.service import InferenceService
from ipuserve.gateway.status import grpc_status_name

log = logging.getLogger(__name__)

#: the service's full name in the specification: the first part of every RPC path
SERVICE_NAME = "inference.GRPCInferenceService"
#: the same service under our .proto's own name, for a client generated from
#: gateway/proto/inference.proto rather than from the specification's file
ALIAS_NAME = "ipuserve.oip.GRPCInferenceService"
#: gRPC's health checking protocol (what Kubernetes' gRPC probe calls)
HEALTH_NAME = "grpc.health.v1.Health"
#: the services whose health Check answers: "" (the server's) and the inference one
HEALTH_SERVICES = ("", SERVICE_NAME, ALIAS_NAME)
#: the role whose tokens may call the guarded RPCs (see gateway/auth.py)
ROLE = "infer"
#: ... and the model repository's
ADMIN_ROLE = "admin"

#: the largest message of the calls other than ModelInfer (names and a few parameters)
SMALL_MESSAGE_BYTES = 1 << 20
#: how often the server pings each connection (a dead or deaf peer is closed when the
#: ping goes unanswered for the write timeout)
KEEPALIVE_S = 60.0
#: a client's pings without calls must be this far apart ...
MIN_CLIENT_PING_S = 300.0
#: ... or the connection is closed after this many too early
PING_STRIKES = 2

#: one RPC's coroutine: request message and call context to response message
Handler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Message]]


async def start_grpc(
    service: InferenceService, address: str, config: GatewayConfig, tokens: Tokens
) -> grpc.aio.Server:
    """Bind ``address`` (HOST:PORT), start serving and return the server; the caller
    stops it (``await server.stop(grace)``). :func:`start_grpc_bound` also tells the
    port that port 0 got."""
    server, _ = await start_grpc_bound(service, address, config, tokens)
    return server


async def start_grpc_bound(
    service: InferenceService, address: str, config: GatewayConfig, tokens: Tokens
) -> tuple[grpc.aio.Server, str]:
    """:func:`start_grpc`, and the HOST:PORT it bound: grpcio's server does not say
    which port ``HOST:0`` got once it is bound, only the call that binds it does, so
    this is the race-free way to serve on a free port. Logs the bound address."""
    server = grpc.aio.server(options=server_options(config))
    servicer = _Servicer(service, tokens, config.max_body_bytes)
    handlers = [servicer.handler(n) for n in (SERVICE_NAME, ALIAS_NAME)]
    server.add_generic_rpc_handlers((*handlers, servicer.health_handler()))
    tls = _tls_credentials(config)
    port = _bind(server, address, tls)
    await server.start()
    bound = f"{address.rsplit(':', 1)[0]}:{port}"
    log.info("gateway gRPC listening on %s (%s)", bound, "TLS" if tls else "plaintext")
    return server, bound


def server_options(config: GatewayConfig) -> list[tuple[str, Any]]:
    """The channel arguments of the server: the body limit for received messages (the
    sent ones are bounded by what the fabric returns); no SO_REUSEPORT, so a second
    process binding the same port fails instead of silently sharing it -- unless the
    process is one of a supervisor's several (``config.reuse_port``).

    And the connection limits (docs/gateway.md, "Connections"): a connection must
    finish its handshake (TLS, HTTP/2 settings) within ``header_timeout_s``; at most
    ``max_connections`` at once (more are closed as they come); one with no call for
    ``grpc_idle_timeout_s`` is sent GOAWAY and closed (these three checked against
    grpcio 1.85 with raw sockets: tests/gateway/test_connections.py), one older than
    ``grpc_max_connection_age_s`` too (its calls under way get ``request_timeout_s``);
    ``grpc_max_streams`` calls at once per connection; the server pings a connection
    every :data:`KEEPALIVE_S` while calls are under way and closes it when the ping is
    not answered within ``write_timeout_s`` (a peer gone, or one whose connection reads
    nothing; a client library that reads while its caller does not is bounded by the
    call's deadline and the connection's age instead); a client pinging more often
    than every :data:`MIN_CLIENT_PING_S` without calls is sent GOAWAY after
    :data:`PING_STRIKES` such pings (gRPC's defaults, spelt out here).

    No bandwidth-delay probing: with it grpcio widens a stream's receive window before
    the application asks for the message, so eight 60 MiB calls with no token cost the
    gateway 18-80 MiB before they were refused; without it, ~1 MiB (the window stays
    at its initial size until the call's token passed and the handler reads). On
    loopback a 48 MiB message arrived no slower (median 79 ms against 97 ms).
    """
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", config.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", int(config.reuse_port)),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.server_handshake_timeout_ms", _ms(config.header_timeout_s)),
        ("grpc.max_allowed_incoming_connections", config.max_connections),
        ("grpc.max_concurrent_streams", config.grpc_max_streams),
        ("grpc.keepalive_time_ms", _ms(KEEPALIVE_S)),
        ("grpc.keepalive_timeout_ms", _ms(config.write_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(MIN_CLIENT_PING_S)),
        ("grpc.http2.max_ping_strikes", PING_STRIKES),
    ]
    if config.grpc_idle_timeout_s:
        options.append(("grpc.max_connection_idle_ms", _ms(config.grpc_idle_timeout_s)))
    if config.grpc_max_connection_age_s:
        options += [
            ("grpc.max_connection_age_ms", _ms(config.grpc_max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", _ms(config.request_timeout_s)),
        ]
    return options


def _ms(seconds: float) -> int:
    """Milliseconds as a channel argument takes them (a C int)."""
    return min(max(1, round(seconds * 1000)), 2**31 - 1)


def _tls_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None or config.tls_key is None:
        return None
    try:
        key, cert = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the gateway's TLS certificate or key: {exc}") from exc
    return grpc.ssl_server_credentials([(key, cert)])


def _bind(server: grpc.aio.Server, address: str, tls: grpc.ServerCredentials | None) -> int:
    try:
        port = server.add_secure_port(address, tls) if tls else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio >= 1.5x raises; older ones returned 0
        raise ConfigError(f"cannot serve gRPC on {address!r}: {exc}") from exc
    if not port:
        raise ConfigError(f"cannot serve gRPC on {address!r} (in use, or not an address)")
    return port


class _Servicer:
    """The RPCs, each a coroutine from a request message to a response message."""

    def __init__(self, service: InferenceService, tokens: Tokens, max_bytes: int) -> None:
        self._service = service
        self._tokens = tokens
        self._max_bytes = max_bytes

    def handler(self, name: str) -> grpc.GenericRpcHandler:
        rpcs: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "ServerLive": self._rpc(self.server_live, pb.ServerLiveRequest, guarded=False),
            "ServerReady": self._rpc(self.server_ready, pb.ServerReadyRequest, guarded=False),
            "ModelReady": self._rpc(self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": self._rpc(self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": self._rpc(self.model_metadata, pb.ModelMetadataRequest),
            "ModelInfer": self._rpc(self.model_infer, pb.ModelInferRequest, counted=True),
            "ModelStatistics": self._rpc(self.model_statistics, pb.ModelStatisticsRequest),
            "RepositoryIndex": self._rpc(
                self.repository_index, pb.RepositoryIndexRequest, role=ADMIN_ROLE
            ),
            "RepositoryModelLoad": self._rpc(
                self.repository_load, pb.RepositoryModelLoadRequest, role=ADMIN_ROLE
            ),
            "RepositoryModelUnload": self._rpc(
                self.repository_unload, pb.RepositoryModelUnloadRequest, role=ADMIN_ROLE
            ),
        }
        rpcs["ModelConfig"] = self._rpc(self.model_config, pb.ModelConfigRequest)
        return grpc.method_handlers_generic_handler(name, rpcs)

    def health_handler(self) -> grpc.GenericRpcHandler:
        """grpc.health.v1.Health/Check, open as ServerLive is (probes carry no token)."""
        check = self._rpc(self.health_check, pb.HealthCheckRequest, guarded=False)
        return grpc.method_handlers_generic_handler(HEALTH_NAME, {"Check": check})

    def _rpc(
        self,
        fn: Handler,
        request: type[Message],
        *,
        guarded: bool = True,
        role: str = ROLE,
        counted: bool = False,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """One RPC: the token check of ``role`` (``guarded``) and the message's size,
        before the message is even received, then its parse, then ``fn``; an error
        becomes the call's status. ``counted``: an inference call, counted with its
        status code by model, and allowed the body limit (the others
        :data:`SMALL_MESSAGE_BYTES`).

        Registered as a stream-unary handler receiving bytes: grpcio receives and
        parses a unary handler's request before calling it, so a caller with no token
        would cost a full message's parse; here nothing is read until the token
        passed, and the bytes are parsed (off the loop when large) only if they fit."""
        limit = self._max_bytes if counted else min(SMALL_MESSAGE_BYTES, self._max_bytes)

        async def call(_requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
            req: Message | None = None
            try:
                if guarded:
                    peer = grpc_peer_host(context.peer())
                    self._tokens.check(_authorization(context), role, door="grpc", peer=peer)
                req = await _receive(context, request, limit, counted)
                response = await fn(req, context)
                if counted:
                    self._service.answered("grpc", _model_name(req), "OK")
                return response
            except asyncio.CancelledError:  # the client cancelled, or its deadline passed
                if counted:
                    self._service.answered("grpc", _model_name(req), _cancelled(context))
                raise
            except Exception as exc:
                code, details = _status(exc)
            if counted:
                self._service.answered("grpc", _model_name(req), code.name)
            await context.abort(code, details)
            raise AssertionError("unreachable: abort raises")  # pragma: no cover

        return grpc.stream_unary_rpc_method_handler(call, response_serializer=_serialize)

    async def server_live(self, _req: pb.ServerLiveRequest, _ctx: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self._service.live())

    async def server_ready(self, _req: pb.ServerReadyRequest, _ctx: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._service.ready())

    async def model_ready(self, req: pb.ModelReadyRequest, _ctx: Any) -> pb.ModelReadyResponse:
        ready = await self._service.model_ready(req.name, req.version or None)
        return pb.ModelReadyResponse(ready=ready)

    async def server_metadata(
        self, _req: pb.ServerMetadataRequest, _ctx: Any
    ) -> pb.ServerMetadataResponse:
        return convert.server_metadata(self._service.server_metadata())

    async def model_metadata(
        self, req: pb.ModelMetadataRequest, _ctx: Any
    ) -> pb.ModelMetadataResponse:
        meta = await self._service.model_metadata(req.name, req.version or None)
        return convert.model_metadata(meta)

    async def model_config(self, req: pb.ModelConfigRequest, _ctx: Any) -> pb.ModelConfigResponse:
        info, versions = await self._service.model_listing(req.name, req.version or None)
        return to_proto(triton_config(info, versions))

    async def health_check(self, req: pb.HealthCheckRequest, _ctx: Any) -> pb.HealthCheckResponse:
        if req.service not in HEALTH_SERVICES:  # the protocol's answer for an unknown one
            raise UnknownModelError(f"no service {req.service[:100]!r} here")
        return health(self._service.ready())

    async def model_infer(
        self, req: pb.ModelInferRequest, ctx: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInferResponse:
        request = await off_loop(
            req.ByteSize(), convert.infer_request, req, ctx.time_remaining(), self._max_bytes
        )
        response = await self._service.infer(request)
        return convert.infer_response(response, typed=convert.wants_typed_outputs(req))

    async def model_statistics(
        self, req: pb.ModelStatisticsRequest, _ctx: Any
    ) -> pb.ModelStatisticsResponse:
        stats = await self._service.statistics(req.name or None, req.version or None)
        return convert.statistics(stats)

    async def repository_index(
        self, req: pb.RepositoryIndexRequest, _ctx: Any
    ) -> pb.RepositoryIndexResponse:
        found = await self._service.repository.index(ready=req.ready)
        response = pb.RepositoryIndexResponse()
        for entry in found:
            response.models.add(
                name=entry.name, version=entry.version, state=entry.state, reason=entry.reason
            )
        return response

    async def repository_load(
        self, req: pb.RepositoryModelLoadRequest, _ctx: Any
    ) -> pb.RepositoryModelLoadResponse:
        config = req.parameters["config"].string_param if "config" in req.parameters else None
        await self._service.repository.load(req.model_name, config or None)
        return pb.RepositoryModelLoadResponse()

    async def repository_unload(
        self, req: pb.RepositoryModelUnloadRequest, _ctx: Any
    ) -> pb.RepositoryModelUnloadResponse:
        await self._service.repository.unload(req.model_name)
        return pb.RepositoryModelUnloadResponse()


async def _receive(
    context: grpc.aio.ServicerContext[Any, Any], request: type[Message], limit: int, infer: bool
) -> Message:
    """The call's one request message: its bytes within ``limit``, then parsed (an
    ``infer`` request's tensor sizes checked against its shapes first)."""
    raw = await context.read()
    if not isinstance(raw, bytes):  # grpc.aio.EOF: the client sent no message
        raise RequestError(f"the call carried no {request.DESCRIPTOR.name} message")
    if len(raw) > limit:
        raise PayloadTooLargeError(
            f"the {request.DESCRIPTOR.name} message ({len(raw)} bytes) is over the "
            f"gateway's limit of {limit} bytes for this call"
        )
    return await off_loop(len(raw), _parse, request, raw, infer)


def _parse(request: type[Message], raw: bytes, infer: bool) -> Message:
    if infer:
        precheck(raw)
    try:
        return request.FromString(raw)
    except DecodeError as exc:
        raise RequestError(f"the message is not a valid {request.DESCRIPTOR.name}: {exc}") from None


def _model_name(req: Message | None) -> str:
    """The model an inference request names ("" before it was parsed)."""
    name: str = getattr(req, "model_name", "")
    return name


def _cancelled(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The code a call grpcio cancelled under us is counted with: its deadline's, or
    the client's own cancel (a hang-up, as HTTP's 499), never a failure of ours."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _authorization(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The call's ``authorization`` metadata (gRPC lower-cases metadata keys)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and details of a failed call: ipuserve's errors by the one table;
    anything else is a bug of ours, logged with its traceback and answered INTERNAL."""
    code = getattr(grpc.StatusCode, grpc_status_name(exc), grpc.StatusCode.INTERNAL)
    if isinstance(exc, IpuserveError):
        return code, str(exc) or type(exc).__name__
    log.error("gRPC call failed unexpectedly", exc_info=exc)
    return code, f"internal error in the gateway: {type(exc).__name__}: {exc}"
