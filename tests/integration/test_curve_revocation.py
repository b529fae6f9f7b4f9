"""Keys revoked on open connections: a key removed from an allow-list, then SIGHUP, is
refused from its sender's next message, not at its next handshake (issue 22, item 3).

Real processes: ``ipuserve broker`` with keys, real ``ipuserve worker`` processes with
theirs, real Clients. Every wait is on something observable: the broker's reload line,
its drop line, a reply, a metric.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from ipuserve.errors import UnauthenticatedError
from ipuserve.security import fingerprint, load_public_key
from tests.helpers import (
    BrokerProc,
    Processes,
    add_expected,
    add_inputs,
    fn_worker_argv,
    metric,
    runner_worker_argv,
    scrape,
    start_worker,
    wait_until,
    write_example,
)
from tests.integration import test_curve
from tests.integration.test_curve import KeyDirs, assert_served, client, models_cli

pytestmark = pytest.mark.slow

keys = test_curve.keys  # the fixture: key files made by `ipuserve keys generate`
REFUSED_MESSAGES = "ipuserve_broker_refused_messages_total"
#: a job on the worker to be revoked: far longer than the test, so whatever it held
#: can only be answered by the other worker
SLOW_JOB_MS = 600_000


def revoke(broker: BrokerProc, keys: KeyDirs, allow_list: str, name: str, left: str) -> None:
    """Remove ``name``'s key from ``allow_list`` and SIGHUP the broker; returns once the
    broker logged the reload (``left``: what its line says is left, e.g. "1 client key")."""
    (keys.root / allow_list / f"{name}.key").unlink()
    mark = broker.proc.mark()
    os.kill(broker.proc.pid, signal.SIGHUP)
    broker.proc.wait_for(rf"allow-lists reloaded: .*\b{left}\b", since=mark)


def refused_messages(broker: BrokerProc, socket: str) -> float:
    return scrape(broker.metrics_url).get(f'{REFUSED_MESSAGES}{{socket="{socket}"}}', 0.0)


def in_flight(broker: BrokerProc) -> float:
    """Requests held by workers (a gauge the broker refreshes every heartbeat)."""
    return metric(scrape(broker.metrics_url), "ipuserve_broker_requests_in_flight")


def key_fingerprint(keys: KeyDirs, name: str) -> str:
    return fingerprint(load_public_key(keys.root / f"{name}.key"))


def test_a_revoked_client_is_refused_on_its_open_connection_and_the_others_served(
    processes: Processes, keys: KeyDirs, tmp_path: Path
) -> None:
    model = write_example(tmp_path / "noop.popef", "noop", "--batch-size", "4", "--elements", "8")
    keys.generate("other", into="clients")
    broker = test_curve.start_curve_broker(processes, keys, "2 client keys, 1 worker key")
    worker_args = ("--name", "noop", *keys.peer_options("worker"))
    start_worker(processes, broker, runner_worker_argv(model, args=worker_args))

    with client(broker, keys, "client") as doomed, client(broker, keys, "other") as other:
        assert_served(doomed, seed=0)
        assert_served(other, seed=1)
        assert refused_messages(broker, "frontend") == 0

        revoke(broker, keys, "clients", "client", left="1 client key")

        with pytest.raises(UnauthenticatedError, match="no longer in the admin or client"):
            doomed.infer("noop", {"input": np.zeros((1, 8), np.float32)})
        with pytest.raises(UnauthenticatedError, match=key_fingerprint(keys, "client")):
            doomed.models()
        assert_served(other, seed=2)  # a listed client's open connection goes on
        assert other.stats.reconnects == 0
    broker.proc.wait_for(
        rf"refused a peer on the frontend socket: key {key_fingerprint(keys, 'client')} "
        r"no longer in the admin or client allow-list"
    )
    samples = scrape(broker.metrics_url)
    assert samples[f'{REFUSED_MESSAGES}{{socket="frontend"}}'] >= 2
    assert samples['ipuserve_broker_errors_total{code="UNAUTHENTICATED",model=""}'] >= 2


def test_a_revoked_worker_is_dropped_and_its_jobs_served_by_another_none_lost(
    processes: Processes, keys: KeyDirs
) -> None:
    keys.generate("doomed", into="workers")
    broker = test_curve.start_curve_broker(processes, keys, "1 client key, 2 worker keys")
    # the worker to be revoked takes SLOW_JOB_MS a job: it holds what it is sent
    slow = ("--worker-id", "doomed", "--delay-ms", str(SLOW_JOB_MS), *keys.peer_options("doomed"))
    doomed = start_worker(processes, broker, fn_worker_argv("add", *slow))

    given = [add_inputs(rows=2, seed=n) for n in range(4)]
    with client(broker, keys, "client", timeout=120) as c:
        futures = [c.infer_async("add", inputs) for inputs in given]
        # placed on the only worker, which cannot answer them in the test's time;
        # then another worker joins
        wait_until(lambda: in_flight(broker) >= 1, timeout=60)
        good = ("--worker-id", "good", *keys.peer_options("worker"))
        start_worker(processes, broker, fn_worker_argv("add", *good))

        revoke(broker, keys, "workers", "doomed", left="1 worker key")
        dropped = broker.proc.wait_for(
            r"worker doomed dropped \(revoked\); re-queueing the (\d+) job"
        )
        assert int(dropped[1]) >= 1  # it held jobs, and they went back to the queue
        for inputs, future in zip(given, futures, strict=True):  # none lost, none failed
            np.testing.assert_array_equal(future.result(timeout=120)["z"], add_expected(inputs))
        later = [add_inputs(rows=1, seed=10 + n) for n in range(8)]  # the others' turn now
        for inputs, future in [(x, c.infer_async("add", x)) for x in later]:
            np.testing.assert_array_equal(future.result(timeout=120)["z"], add_expected(inputs))
        (info,) = models_cli(broker, keys, "admin")
        assert [w["worker_id"] for w in info["workers"]] == ["good"]
    # the worker learns it: told to reconnect, its new handshake is refused at ZAP
    doomed.wait_for(r"broker asked us to reconnect")
    doomed.wait_for(r"refused this worker's connection: ZAP status 400")
    broker.proc.wait_for(
        rf"refused a peer on the backend socket: key {key_fingerprint(keys, 'doomed')} "
        r"no longer in the worker allow-list"
    )
    samples = scrape(broker.metrics_url)
    assert samples[f'{REFUSED_MESSAGES}{{socket="backend"}}'] >= 1
    assert samples['ipuserve_broker_workers_lost_total{reason="revoked"}'] == 1
    assert not [name for name in samples if name.startswith("ipuserve_broker_errors_total")]
