"""The HTTP door: the Open Inference Protocol's REST endpoints on aiohttp.

Every endpoint but the health probes needs an ``infer`` token when tokens are
configured (``/metrics`` too: Prometheus scrapes with a bearer token), and the model
repository's (``/v2/repository/...``) an ``admin`` one. Every inference call is counted
with its status (``ipuserve_gateway_requests_total{door="http"}``); a client that hangs
up before its answer (mid-body) is counted as ``499``, nginx's and Triton's "client
closed request", not as a failure of ours, and answered nothing.
Errors are ``{"error": "..."}`` with the status from :mod:`gateway.status`; an
exception no handler expected is a 500, logged with its traceback (a bug of ours),
and never a client's mistake. Every response names the server ``ipuserve`` only
(``Server``: no Python or aiohttp version for a scanner to match).
A body over ``max_body_bytes`` is refused (413) from its ``Content-Length`` before it
is read; the body must arrive within ``body_timeout_s`` (408). The connection guards
(:mod:`gateway.http_guard`) bound how long a client may take to send its headers (TLS
handshake included) and to read its answer, and how many connections are open, in all
and per address; the door accepts through :mod:`gateway.accept_guard`, which backs off
when descriptors run out. docs/gateway.md lists the endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

from aiohttp import ClientConnectionResetError, web
from aiohttp.http_exceptions import HttpProcessingError

from ipuserve.errors import InvalidInputError, IpuserveError, PayloadTooLargeError, RequestError
from ipuserve.gateway.accept_guard import Acceptor, listening_sockets
from ipuserve.gateway.auth import Tokens
from ipuserve.gateway.config import GatewayConfig
from ipuserve.gateway.http_body import (
    BODY_OPTION,
    JSON_OPTION,
    encoding_of,
    inflate,
    read_head,
    read_raw,
    too_large,
)
from ipuserve.gateway.http_codec import (
    HEADER_LENGTH,
    declared_binary_bytes,
    json_length,
    parse_infer,
    render_infer,
)
from ipuserve.gateway.http_guard import ConnectionGuards
from ipuserve.gateway.model_config import triton_config
from ipuserve.gateway.offload import off_loop
from ipuserve.gateway.service import InferenceService, ModelMetadata
from ipuserve.gateway.stats import ModelStatistics
from ipuserve.gateway.status import http_status
from ipuserve.gateway.tensors import shown

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SERVICE = web.AppKey("service", InferenceService)
TOKENS = web.AppKey("tokens", Tokens)
CONFIG = web.AppKey("config", GatewayConfig)
GUARDS = web.AppKey("guards", ConnectionGuards)

#: what every response's ``Server`` header says
SERVER = "ipuserve"
#: a binary-extension body larger than this is read header first (_read_infer_body)
TWO_STEP_BYTES = 1 << 20
#: the status counted for a client that hung up before its answer (nginx's, Triton's)
HUNG_UP = 499
#: what reading from, or writing to, a client that left raises
_GONE = (ConnectionResetError, ClientConnectionResetError)


def error_response(status: int, message: str) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Headers are in (the connection guard stops its clock); tokens; errors as JSON."""
    guards = request.app[GUARDS]
    guards.request_started(request.transport)
    try:
        response = await _answer(request, handler)
        _count(request, response.status)
        return response
    except asyncio.CancelledError:  # its task cancelled: the connection is gone
        _count(request, HUNG_UP)
        raise
    finally:
        guards.request_done(request.transport)


def _count(request: web.Request, status: int) -> None:
    """Count an inference call's answer (the other endpoints are not counted)."""
    if getattr(request.match_info, "handler", None) is _infer:
        model = request.match_info["name"]
        request.app[SERVICE].answered("http", model, str(status))


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler's response, after the token check; errors as JSON."""
    try:
        if not request.path.startswith("/v2/health/"):
            role = "admin" if request.path.startswith("/v2/repository/") else "infer"
            authorization = request.headers.get("Authorization")
            request.app[TOKENS].check(authorization, role, door="http", peer=request.remote)
        return await handler(request)
    except IpuserveError as exc:
        return _closing(error_response(http_status(exc), str(exc)))
    except web.HTTPException as exc:  # no such route, wrong method...
        if exc.status < 400:
            raise
        return _closing(error_response(exc.status, exc.text or exc.reason))
    except _GONE:  # the client left mid-body: nobody to answer, nothing of ours failed
        log.debug("%s %s: the client hung up", request.method, request.path)
        return web.Response(status=HUNG_UP)  # aiohttp's write fails quietly: counted
    except Exception:
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return error_response(500, "internal error in the gateway (logged)")


def _closing(response: web.Response) -> web.Response:
    """Close the connection after a 408 or a 413: the rest of the body may still be on
    its way, and reading it to keep the connection is what the limit refuses (aiohttp
    still lingers ``lingering_time`` reading it, so the client sees the answer)."""
    if response.status in (408, 413):
        response.force_close()
    return response


def _version(request: web.Request) -> str | None:
    return request.match_info.get("version")


async def _live(request: web.Request) -> web.Response:
    return web.json_response({"live": request.app[SERVICE].live()})


async def _ready(request: web.Request) -> web.Response:
    if request.app[SERVICE].ready():
        return web.json_response({"ready": True})
    return error_response(503, "not ready: no broker connected")


async def _server_metadata(request: web.Request) -> web.Response:
    meta = request.app[SERVICE].server_metadata()
    return web.json_response(
        {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}
    )


def metadata_json(meta: ModelMetadata) -> dict[str, Any]:
    def tensors(items: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": tensors(meta.inputs),
        "outputs": tensors(meta.outputs),
    }


async def _model_metadata(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    meta = await service.model_metadata(request.match_info["name"], _version(request))
    return web.json_response(metadata_json(meta))


async def _model_config(request: web.Request) -> web.Response:
    """Triton's model configuration (gateway/model_config.py)."""
    info, versions = await request.app[SERVICE].model_listing(
        request.match_info["name"], _version(request)
    )
    return web.json_response(triton_config(info, versions))


async def _model_ready(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if await request.app[SERVICE].model_ready(name, _version(request)):
        return web.json_response({"name": name, "ready": True})
    return error_response(503, f"model {shown(name)} is not ready: no worker serves it")


def statistics_json(stats: ModelStatistics) -> dict[str, Any]:
    """Triton's statistics extension shape."""
    durations = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
    return {
        "name": stats.name,
        "version": stats.version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {key: asdict(getattr(stats, key)) for key in durations},
        "batch_stats": [],
    }


async def _statistics(request: web.Request) -> web.Response:
    service, name = request.app[SERVICE], request.match_info.get("name")
    stats = await service.statistics(name, _version(request))
    return web.json_response({"model_stats": [statistics_json(s) for s in stats]})


async def _metrics(request: web.Request) -> web.Response:
    """The gateway's metrics in the Prometheus text format (OpenMetrics to a scraper
    that asks for it), every process's when several share them (gateway/metrics.py)."""
    body, content_type = request.app[SERVICE].metrics.page(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _infer(request: web.Request) -> web.Response:
    body = await _read_infer_body(request)
    parsed = await off_loop(
        len(body),
        parse_infer,
        body,
        request.headers.get(HEADER_LENGTH),
        request.match_info["name"],
        _version(request),
        request.app[CONFIG].max_body_bytes,
    )
    response = await request.app[SERVICE].infer(parsed.request)
    payload, headers = render_infer(parsed, response)
    return web.Response(body=payload, headers=headers)


async def _repository_index(request: web.Request) -> web.Response:
    """Triton's index: ``[{name, version, state, reason}]``; a body ``{"ready": true}``
    lists the READY versions only."""
    body = await _json_body(request)
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidInputError(f"'ready' must be true or false, not {ready!r}")
    found = await request.app[SERVICE].repository.index(ready=ready)
    return web.json_response([entry.to_json() for entry in found])


async def _repository_load(request: web.Request) -> web.Response:
    """Load as Triton does; the body's ``parameters.config`` (a model config as JSON
    text, what tritonclient sends) may name the versions (gateway/repository.py)."""
    parameters = (await _json_body(request)).get("parameters") or {}
    config = parameters.get("config") if isinstance(parameters, dict) else None
    if config is not None and not isinstance(config, str):
        config = json.dumps(config)  # a config given as a JSON object rather than text
    await request.app[SERVICE].repository.load(request.match_info["name"], config)
    return web.Response()


async def _repository_unload(request: web.Request) -> web.Response:
    await request.app[SERVICE].repository.unload(request.match_info["name"])
    return web.Response()


async def _json_body(request: web.Request) -> dict[str, Any]:
    """A small JSON object body, or {} for none."""
    body = await _read_body(request, request.app[CONFIG].json_limit, JSON_OPTION)
    if not body.strip():
        return {}
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidInputError(f"the request body is not JSON: {exc}"[:300]) from None
    if not isinstance(parsed, dict):
        raise InvalidInputError("the request body must be a JSON object")
    return parsed


async def _read_infer_body(request: web.Request) -> bytearray:
    """An infer request's body: all JSON within ``max_json_bytes``; with the binary
    extension, its JSON header within ``max_json_bytes`` and the whole within
    ``max_body_bytes``. A binary body that is large, chunked or compressed is read (or
    inflated) header first, and no further than its inputs' ``binary_data_size``
    declare (:func:`~gateway.http_codec.declared_binary_bytes`), so one whose sizes lie
    is refused having cost its header, not its length."""
    config = request.app[CONFIG]
    header = request.headers.get(HEADER_LENGTH)
    if header is None:
        return await _read_body(request, config.json_limit, JSON_OPTION)
    length = request.content_length
    encoding = encoding_of(request.headers.get("Content-Encoding"))
    if encoding is None and length is not None and length <= TWO_STEP_BYTES:
        body = await _read_body(request, config.max_body_bytes)  # the common case
        _check_json_header(json_length(header, len(body)), config.json_limit)
        return body
    limit = config.max_body_bytes
    if length is not None and length > limit:
        raise PayloadTooLargeError(too_large(length, limit))
    json_end = json_length(header, limit if length is None or encoding else length)
    _check_json_header(json_end, config.json_limit)
    async with _body_deadline(config):
        if encoding is not None:
            raw = await read_raw(request.content, length, limit)
        else:
            head = await read_head(request.content, json_end)
            total = json_end + await off_loop(len(head), declared_binary_bytes, head)
            return await _read_declared(request, head, total, limit)
    return await off_loop(
        len(raw), inflate, raw, encoding, limit, BODY_OPTION, json_end, declared_binary_bytes
    )


async def _read_declared(request: web.Request, head: bytes, total: int, limit: int) -> bytearray:
    """The rest of a binary body whose header declared ``total`` bytes in all."""
    length = request.content_length
    if total > limit:
        raise PayloadTooLargeError(too_large(total, limit, "declared "))
    if length is not None and length != total:
        raise RequestError(
            f"the inputs' binary_data_size add up to {total - len(head)} bytes, but "
            f"{length - len(head)} bytes follow the JSON header"
        )
    try:
        return await read_raw(request.content, length, total, prefix=head)
    except PayloadTooLargeError:  # chunked, and more came than the header declared
        raise RequestError(
            f"more than the {total} bytes the JSON header and its inputs' binary_data_size "
            "declare came in the body"
        ) from None


def _check_json_header(size: int, limit: int) -> None:
    if size > limit:
        raise PayloadTooLargeError(
            f"the request's JSON header ({size} bytes) is over the gateway's limit of "
            f"{limit} bytes for JSON ({JSON_OPTION})"
        )


async def _read_body(
    request: web.Request, limit: int | None = None, option: str = BODY_OPTION
) -> bytearray:
    """The body, inflated if it came compressed (gateway/http_body.py), within
    ``limit`` (by default the body limit) and the body timeout."""
    config = request.app[CONFIG]
    limit = config.max_body_bytes if limit is None else limit
    encoding = encoding_of(request.headers.get("Content-Encoding"))
    async with _body_deadline(config):
        raw = await read_raw(request.content, request.content_length, limit, option)
    if encoding is None:
        return raw
    return await off_loop(len(raw), inflate, raw, encoding, limit, option)


@contextlib.asynccontextmanager
async def _body_deadline(config: GatewayConfig) -> AsyncIterator[None]:
    """The body must arrive within ``body_timeout_s`` of its headers (else 408)."""
    try:
        async with asyncio.timeout(config.body_timeout_s):
            yield
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=f"the request body did not arrive within {config.body_timeout_s:g} s"
        ) from None


class _ConnectionLog(logging.LoggerAdapter[logging.Logger]):
    """The logger of aiohttp's connection handler. A request its HTTP parser refuses
    (a bad request line, header or length: aiohttp answers 400 itself, before any
    route) is a client's mistake: one INFO line, no traceback. Anything else it logs
    is ours to see in full."""

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            first = (exc.message.splitlines() or [""])[0]  # aiohttp adds a caret drawing
            self.logger.info("refused a malformed request (%d): %s", exc.code, first[:200])
        else:
            super().exception(msg, *args, **kwargs)


async def _name_the_server(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER


def make_app(service: InferenceService, config: GatewayConfig, tokens: Tokens) -> web.Application:
    app = web.Application(middlewares=[_guarded], client_max_size=config.max_body_bytes)
    app.on_response_prepare.append(_name_the_server)
    app[SERVICE] = service
    app[TOKENS] = tokens
    app[CONFIG] = config
    app[GUARDS] = ConnectionGuards(
        header_timeout_s=config.header_timeout_s,
        max_connections=config.max_connections,
        max_per_peer=config.max_connections_per_peer,
        write_timeout_s=config.write_timeout_s,
    )
    r = app.router
    r.add_get("/v2/health/live", _live)
    r.add_get("/v2/health/ready", _ready)
    r.add_get("/metrics", _metrics)
    r.add_get("/v2", _server_metadata)
    r.add_get("/v2/models/stats", _statistics)  # before /v2/models/{name}
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        r.add_get(base, _model_metadata)
        r.add_get(base + "/ready", _model_ready)
        r.add_get(base + "/config", _model_config)
        r.add_get(base + "/stats", _statistics)
        r.add_post(base + "/infer", _infer)
    r.add_post("/v2/repository/index", _repository_index)
    r.add_post("/v2/repository/models/{name}/load", _repository_load)
    r.add_post("/v2/repository/models/{name}/unload", _repository_unload)
    return app


class HttpServer:
    """The HTTP door bound to ``host:port``, behind the connection guards and the
    acceptors of its listening sockets (gateway/accept_guard.py)."""

    def __init__(self, app: web.Application, runner: web.AppRunner, acceptors: list[Acceptor]):
        self.app = app
        self._runner = runner
        self.acceptors = acceptors

    @property
    def port(self) -> int:
        port: int = self.acceptors[0].sock.getsockname()[1]
        return port

    @property
    def guards(self) -> ConnectionGuards:
        return self.app[GUARDS]

    async def stop(self) -> None:
        """Stop accepting, let requests under way finish (up to the runner's shutdown
        timeout), close the connections."""
        for acceptor in self.acceptors:
            acceptor.close()
        await self._runner.cleanup()
        self.guards.close_all()  # those aiohttp never saw: in a TLS handshake, refused


async def start_http(
    service: InferenceService,
    host: str,
    port: int,
    config: GatewayConfig,
    tokens: Tokens,
    ssl_context: ssl.SSLContext | None = None,
) -> HttpServer:
    """Serve the HTTP door on ``host:port`` (port 0: any free port)."""
    app = make_app(service, config, tokens)
    runner = web.AppRunner(
        app,
        access_log=None,
        logger=_ConnectionLog(log),
        keepalive_timeout=config.header_timeout_s,
        handle_signals=False,
        shutdown_timeout=5.0,
        # after an answer that left the body unread (413, 408, an early error), read and
        # drop what still comes for a second, so the client sees the answer rather than
        # a reset, then close (aiohttp's default lingers 10 s)
        lingering_time=1.0,
        # the body is inflated by the gateway, capped as it inflates (gateway/http_body.py)
        auto_decompress=False,
    )
    await runner.setup()
    assert runner.server is not None
    guards = app[GUARDS]
    guards.ssl_context = ssl_context  # TLS is the guard's: it times the handshake
    factory = guards.factory(runner.server)
    sockets = listening_sockets(
        host, port, backlog=min(config.max_connections, 4096), reuse_port=config.reuse_port
    )
    acceptors = [Acceptor(sock, factory) for sock in sockets]
    for acceptor in acceptors:
        acceptor.start()
    return HttpServer(app, runner, acceptors)
