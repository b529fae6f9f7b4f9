"""Nothing is lost at the front door when things die under it: a broker killed -9 and
restarted, and the gateway itself restarted, while client tasks send continuously.
Every request is answered correctly or fails with a clear status (503/504, or a refused
connection while no gateway listens); none hangs; and requests succeed again after."""

from __future__ import annotations

import asyncio
import collections
import threading
import urllib.error
import urllib.request
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from tests.gateway.conftest import Fabric, GatewayProc, mlp_input, restart_gateway, start_gateway
from tests.helpers import restart_broker, wait_registered, wait_until

pytestmark = pytest.mark.slow

TASKS = 4
#: no request may take longer than this (the gateway's own timeout is 10 s)
HANG_S = 60.0
#: successes to see before and after each fault
PROGRESS = 20


class Load:
    """Client tasks sending continuously in a thread's event loop; outcomes tallied."""

    def __init__(self, fabric: Fabric, gateway: GatewayProc) -> None:
        self.fabric, self.address = fabric, gateway.host_port
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.wrong: list[str] = []
        #: each refusal's status and message, once
        self.messages: set[str] = set()
        self.ok = 0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * HANG_S)
        assert not self._thread.is_alive(), "the load's tasks did not stop: a request hung"

    def wait_progress(self, more: int = PROGRESS, timeout: float = 120.0) -> None:
        """Wait for ``more`` further correct answers."""
        with self._changed:
            want = self.ok + more
            assert self._changed.wait_for(lambda: self.ok >= want, timeout), (
                f"no progress: {self.ok} answered, outcomes {dict(self.outcomes)}"
            )

    async def _run(self) -> None:
        await asyncio.gather(*(self._task(i) for i in range(TASKS)))

    async def _task(self, index: int) -> None:
        client = aiohttpclient.InferenceServerClient(self.address, conn_timeout=HANG_S)
        want = self.fabric.models["mlp"].reference
        try:
            n = 0
            while not self._stop.is_set():
                n += 1
                x = mlp_input(1 + n % 3, seed=index * 100_000 + n)
                outcome = await self._one(client, x, want)
                with self._changed:
                    self.outcomes[outcome] += 1
                    self.ok += outcome == "ok"
                    self._changed.notify_all()
                if outcome != "ok":
                    await asyncio.sleep(0.05)  # not a hot loop while the fabric is down
        finally:
            await client.close()

    async def _one(self, client: Any, x: np.ndarray[Any, Any], want: Any) -> str:
        tensor = aiohttpclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        try:
            async with asyncio.timeout(HANG_S):
                result = await client.infer("mlp", [tensor])
        except TimeoutError:
            return "hung"
        except InferenceServerException as exc:
            self.messages.add(f"{exc.status()}: {exc.message()}")
            return f"status {exc.status()}"
        except (aiohttp.ClientConnectionError, ConnectionError):
            return "connection"
        got, expected = result.as_numpy("logits"), want({"input": x})["logits"]
        if got is None or not np.allclose(got, expected, rtol=1e-5, atol=1e-5):
            self.wrong.append(f"wrong answer for {x.shape}")
            return "wrong"
        return "ok"


def _status(gateway: GatewayProc, path: str) -> int:
    try:
        with urllib.request.urlopen(gateway.url + path, timeout=HANG_S) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def test_broker_kill_and_gateway_restart_under_load(fabric: Fabric) -> None:
    gateway = start_gateway(fabric.procs, fabric.broker, "--timeout-s", "10")
    with Load(fabric, gateway) as load:
        load.wait_progress()

        marks = {w.name: w.mark() for w in fabric.workers}
        fabric.broker.proc.kill()  # kill -9: the gateway's readiness follows
        wait_until(lambda: _status(gateway, "/v2/health/ready") == 503, timeout=HANG_S)
        fabric.broker = restart_broker(fabric.procs, fabric.broker)  # same ports
        for worker in fabric.workers:
            wait_registered(worker, fabric.broker, since=marks[worker.name])
        load.wait_progress()
        assert _status(gateway, "/v2/health/ready") == 200

        gateway = restart_gateway(fabric.procs, gateway)
        load.wait_progress()
    outcomes = dict(load.outcomes)
    print("outcomes", outcomes)
    assert not load.wrong, outcomes
    assert set(outcomes) <= {"ok", "status 503", "status 504", "connection"}, (
        outcomes,
        load.messages,
    )
