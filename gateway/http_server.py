"""The HTTP door: the Open Inference Protocol's REST endpoints on aiohttp.

Every endpoint but the health probes needs an ``infer`` token when tokens are
configured (``/metrics`` too: Prometheus scrapes with a bearer token), and the model
repository's (``/v2/repository/...``) an ``admin`` one. Every inference call is counted
with its status (``ipuserve_gateway_requests_total{door="http"}``).
Errors are ``{"error": "..."}`` with the status from :mod:`gateway.status`.
A body over ``max_body_bytes`` is refused (413) from its ``Content-Length`` before it
is read; the body must arrive within ``body_timeout_s`` (408). The connection guards
(:mod:`gateway.http_guard`) bound how long a client may take to send its headers (TLS
handshake included) and to read its answer, and how many connections are open, in all
and per address; the door accepts through :mod:`gateway.accept_guard`, which backs off
when descriptors run out. docs/gateway.md lists the endpoints.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web

from ipuserve.errors import InvalidInputError, IpuserveError, PayloadTooLargeError
from ipuserve.gateway.accept_guard import Acceptor, listening_sockets
from ipuserve.gateway.auth import Tokens
from ipuserve.gateway.config import GatewayConfig
from ipuserve.gateway.http_codec import HEADER_LENGTH, parse_infer, render_infer
from ipuserve.gateway.http_guard import ConnectionGuards
from ipuserve.gateway.service import InferenceService, ModelMetadata
from ipuserve.gateway.stats import ModelStatistics
from ipuserve.gateway.status import http_status

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SERVICE = web.AppKey("service", InferenceService)
TOKENS = web.AppKey("tokens", Tokens)
CONFIG = web.AppKey("config", GatewayConfig)
GUARDS = web.AppKey("guards", ConnectionGuards)


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
        if getattr(request.match_info, "handler", None) is _infer:
            model = request.match_info["name"]
            request.app[SERVICE].answered("http", model, str(response.status))
        return response
    finally:
        guards.request_done(request.transport)


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The handler's response, after the token check; errors as JSON."""
    try:
        if not request.path.startswith("/v2/health/"):
            role = "admin" if request.path.startswith("/v2/repository/") else "infer"
            request.app[TOKENS].check(request.headers.get("Authorization"), role, door="http")
        return await handler(request)
    except IpuserveError as exc:
        return _closing(error_response(http_status(exc), str(exc)))
    except web.HTTPException as exc:  # no such route, wrong method...
        if exc.status < 400:
            raise
        return _closing(error_response(exc.status, exc.text or exc.reason))
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


async def _model_ready(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if await request.app[SERVICE].model_ready(name, _version(request)):
        return web.json_response({"name": name, "ready": True})
    return error_response(503, f"model {name!r} is not ready: no worker serves it")


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
    body = await _read_body(request)
    parsed = parse_infer(
        body, request.headers.get(HEADER_LENGTH), request.match_info["name"], _version(request)
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
    body = await _read_body(request)
    if not body.strip():
        return {}
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"the request body is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidInputError("the request body must be a JSON object")
    return parsed


async def _read_body(request: web.Request) -> bytes:
    config = request.app[CONFIG]
    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLargeError(_too_large(request.content_length, limit))
    try:
        async with asyncio.timeout(config.body_timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:  # a chunked body over the limit
        raise PayloadTooLargeError(_too_large(None, limit)) from exc
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=f"the request body did not arrive within {config.body_timeout_s:g} s"
        ) from None


def _too_large(size: int | None, limit: int) -> str:
    given = "" if size is None else f" ({size} bytes)"
    return (
        f"the request body{given} is over the gateway's limit of {limit} bytes (--max-body-bytes)"
    )


def make_app(service: InferenceService, config: GatewayConfig, tokens: Tokens) -> web.Application:
    app = web.Application(middlewares=[_guarded], client_max_size=config.max_body_bytes)
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
        keepalive_timeout=config.header_timeout_s,
        handle_signals=False,
        shutdown_timeout=5.0,
        # after an answer that left the body unread (413, 408, an early error), read and
        # drop what still comes for a second, so the client sees the answer rather than
        # a reset, then close (aiohttp's default lingers 10 s)
        lingering_time=1.0,
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
