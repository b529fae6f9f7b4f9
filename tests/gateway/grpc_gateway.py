"""A gateway process with only its gRPC door, for tests/gateway/test_grpc.py.

    python tests/gateway/grpc_gateway.py --broker tcp://127.0.0.1:PORT [--grpc 127.0.0.1:0]
        [--max-body-bytes N] [--tls-cert PEM --tls-key PEM] [--infer-tokens FILE]

It logs ``gateway gRPC listening on HOST:PORT`` once it serves. The same pieces as
``ipuserve gateway`` (an AsyncClient, the InferenceService, start_grpc), without the
HTTP door, so the gRPC door is tested on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from ipuserve.client import AsyncClient
from ipuserve.gateway.auth import Tokens
from ipuserve.gateway.config import GatewayConfig
from ipuserve.gateway.grpc_server import start_grpc
from ipuserve.gateway.service import InferenceService


async def serve(args: argparse.Namespace) -> None:
    config = GatewayConfig(
        brokers=tuple(args.broker),
        grpc=args.grpc,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        infer_tokens=args.infer_tokens,
        max_body_bytes=args.max_body_bytes,
    )
    tokens = Tokens.from_files(infer=config.infer_tokens)
    client = AsyncClient(list(config.brokers), timeout=config.request_timeout_s)
    service = InferenceService(client, refresh_interval_s=0.2)
    service.start()
    assert config.grpc is not None
    server = await start_grpc(service, config.grpc, config, tokens)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    await service.stop()
    await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", action="append", required=True)
    parser.add_argument("--grpc", default="127.0.0.1:0")
    parser.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--tls-cert", type=Path)
    parser.add_argument("--tls-key", type=Path)
    parser.add_argument("--infer-tokens", type=Path)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
