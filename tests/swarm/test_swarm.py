"""compose.yaml on Docker Swarm, end to end: brokers and workers as services, clients on
the overlay, a worker added, a broker task killed under load.

The stack (conftest.py) is compose.yaml through its Swarm filter, deployed with
``docker stack deploy`` on the engine's single-node swarm: two broker replicas
(``endpoint_mode: dnsrr``, so ``broker`` resolves to every task) and two workers,
under CURVE with keys made on the host and handed over as Swarm secrets. Clients run
in containers on the stack's attachable overlay (tests/swarm/probe.py; the routing
mesh needs IPVS, which CI machines lack), and the host checks every result against
its numpy reference. The tests share the stack and run in file order.

Skipped (see conftest.py) without an engine that can be a single-node swarm; .ci/run
runs them for real.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from ipuserve.runtime.popef import examples
from tests.compose.harness import poll
from tests.swarm.conftest import WORKERS, brokers
from tests.swarm.harness import Stack, Task, probe_inputs, unpack

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]

MODEL = "mlp"
READY_TIMEOUT_S = 180.0
"""Tasks start, pass their health checks (workers: registered), and are listed."""
FAILOVER_TIMEOUT_S = 120.0
REQUESTS = 16
LOAD_WINDOW = 8
PROGRESS_BEFORE_KILL = 200
"""Results the load must have had before a broker is killed (so it is under load)."""


@pytest.fixture(scope="module")
def weights() -> dict[str, Any]:
    """The mlp example's tensor data, built on the host exactly as the image built it."""
    return examples.tensor_arrays(examples.build(MODEL))


def check_report(report: dict[str, Any], weights: dict[str, Any]) -> int:
    """Every answered request of a probe's report equals the numpy reference; how many.

    One reference run over all the requests' samples at once (they are one sample each,
    joined along the batching dimension): thousands of requests check in well under a
    second, where one reference call per request would take minutes.
    """
    outputs = unpack(report)
    indices = [int(i) for i in outputs.pop("index")]
    assert len(set(indices)) == len(indices), "a request answered twice"
    if not indices:
        return 0
    axis = report["spec"]["batching_dim"] or 0
    requests = [probe_inputs(report, index) for index in indices]
    joined = {
        name: np.concatenate([inputs[name] for inputs in requests], axis=axis)
        for name in requests[0]
    }
    expected = examples.reference(MODEL, joined, weights)
    assert set(outputs) == set(expected), f"outputs {sorted(outputs)}"
    for name, want in expected.items():
        got = np.concatenate(list(outputs[name]), axis=axis)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        close = np.isclose(got, want, rtol=1e-4, atol=1e-5)
        wrong = sorted({indices[i] for i in np.nonzero(~close)[axis]})
        assert not wrong, f"output {name!r} differs from numpy for requests {wrong[:10]}"
    return len(indices)


def worker_hostnames(stack: Stack) -> set[str]:
    return {stack.hostname(task) for task in stack.tasks("worker")}


def wait_workers_on_every_broker(stack: Stack, hostnames: set[str]) -> list[Task]:
    """Wait until every broker task lists exactly the workers on ``hostnames`` for MODEL
    (worker ids are HOSTNAME:PID); the broker tasks."""

    def listed() -> list[Task] | None:
        tasks = stack.tasks("broker")
        if len(tasks) != brokers():
            return None
        for task in tasks:
            ids = stack.broker_workers(task).get(MODEL, [])
            if {i.rsplit(":", 1)[0] for i in ids} != hostnames or len(ids) != len(hostnames):
                return None
        return tasks

    return poll(
        listed,
        timeout=READY_TIMEOUT_S,
        interval=1.0,
        what=f"every broker to list the workers {sorted(hostnames)}",
        diagnose=lambda: (
            repr({t.address: stack.broker_workers(t) for t in stack.tasks("broker")})
            + "\n"
            + stack.describe()
        ),
    )


def test_stack_brings_up_brokers_and_workers(stack: Stack) -> None:
    """`docker stack deploy`: the replicas asked for, healthy, each broker on the overlay
    with the same workers registered (each worker serves every broker)."""
    broker_tasks = stack.wait_healthy("broker", brokers(), timeout=READY_TIMEOUT_S)
    stack.wait_healthy("worker", WORKERS, timeout=READY_TIMEOUT_S)
    stack.wait_healthy("gateway", 1, timeout=READY_TIMEOUT_S)  # ready: a broker connected
    assert len({t.address for t in broker_tasks}) == brokers()
    wait_workers_on_every_broker(stack, worker_hostnames(stack))
    # The secrets sit where the Compose volume's files do, a secret key for the
    # image's user alone (uid 10001, mode 0400), a public key for anyone.
    keys = stack.file_modes(
        broker_tasks[0], "/keys/broker/broker.key_secret", "/keys/broker/broker.key"
    )
    assert keys == ["10001 400", "0 444"], keys


def test_requests_through_each_broker_match_numpy(stack: Stack, weights: dict[str, Any]) -> None:
    """A client on the overlay sends through each broker task's own address."""
    for seed, task in enumerate(stack.tasks("broker"), start=1):
        report = stack.run_probe("infer", task.endpoint(5555), str(REQUESTS), str(seed))
        assert check_report(report, weights) == REQUESTS, task


def test_requests_through_the_service_name(stack: Stack, weights: dict[str, Any]) -> None:
    """tcp://broker:5555 names every broker (dnsrr): a client given it gets results."""
    report = stack.run_probe("infer-all", "tcp://broker:5555", str(REQUESTS), "11")
    assert check_report(report, weights) == REQUESTS
    check_client(report)


def test_requests_through_the_gateway_match_numpy(stack: Stack, weights: dict[str, Any]) -> None:
    """The gateway service (http://gateway:8000, Open Inference Protocol JSON, no
    ipuserve client): its model metadata makes the inputs, its answers match numpy."""
    report = stack.run_probe("gateway", "http://gateway:8000", str(REQUESTS), "12")
    assert report["client"] == "http"
    assert check_report(report, weights) == REQUESTS


def test_a_scaled_up_worker_joins_every_broker(stack: Stack) -> None:
    """`docker service scale STACK_worker=3`: the new worker registers with each broker."""
    before = worker_hostnames(stack)
    stack.scale("worker", WORKERS + 1)
    stack.wait_healthy("worker", WORKERS + 1, timeout=READY_TIMEOUT_S)
    after = worker_hostnames(stack)
    assert len(after - before) == 1, (before, after)
    wait_workers_on_every_broker(stack, after)


def test_a_killed_broker_task_under_load(stack: Stack, weights: dict[str, Any]) -> None:
    """SIGKILL one broker task's container while a client keeps LOAD_WINDOW requests
    outstanding through tcp://broker:5555: every request is answered exactly once and
    correctly, Swarm starts a new broker task, and the workers and the running client
    find it by themselves (it lists every worker; it answers the client's requests)."""
    victim = stack.tasks("broker")[0]
    survivors = {t.id for t in stack.tasks("broker")} - {victim.id}
    load = stack.probe("load", "tcp://broker:5555", "21", str(LOAD_WINDOW), "240")
    try:
        poll(
            lambda: True if progress(load) >= PROGRESS_BEFORE_KILL else None,
            timeout=READY_TIMEOUT_S,
            interval=0.2,
            what=f"the load to have {PROGRESS_BEFORE_KILL} results",
            diagnose=lambda: load.logs(tail=20).decode(errors="replace"),
        )
        stack.kill(victim)
        killed = time.monotonic()

        def replaced() -> Task | None:
            tasks = stack.tasks("broker")
            new = [t for t in tasks if t.id != victim.id and t.id not in survivors]
            healthy = len(tasks) == brokers() and all(stack.health(t) == "healthy" for t in tasks)
            return new[0] if new and healthy else None

        successor = poll(
            replaced,
            timeout=FAILOVER_TIMEOUT_S,
            interval=0.5,
            what="Swarm to start a healthy broker task in place of the killed one",
            diagnose=stack.describe,
        )
        print(
            f"new broker task {successor.address} healthy "
            f"{time.monotonic() - killed:.1f} s after the kill"
        )
        # The workers found the new broker: it lists every one of them.
        wait_workers_on_every_broker(stack, worker_hostnames(stack))
        print(f"every worker registered with it {time.monotonic() - killed:.1f} s after the kill")
        # The running client found it too: the new broker answers its requests.
        poll(
            lambda: (
                True
                if stack.broker_metric(successor, "ipuserve_broker_replies_total") > 0
                else None
            ),
            timeout=FAILOVER_TIMEOUT_S,
            interval=0.5,
            what=f"the load's client to send through the new broker {successor.address}",
            diagnose=lambda: load.logs(tail=20).decode(errors="replace"),
        )
        print(f"the load's client sent through it {time.monotonic() - killed:.1f} s after the kill")
        load.kill(signal="SIGUSR1")  # the probe's "stop sending, finish what is out"
        report = stack.probe_result(load, timeout=FAILOVER_TIMEOUT_S)
    finally:
        stack.remove_probes()
    print(
        f"load: sent {report['sent']}, answered {report['answered']}, "
        f"errors {report['error_count']}, longest gap without a result {report['max_gap_s']} s, "
        f"client warnings {report['client_warnings']}"
    )
    check_client(report)
    assert report["error_count"] == 0, report["errors"]
    assert report["duplicates"] == 0
    assert report["answered"] == report["sent"] > PROGRESS_BEFORE_KILL
    assert check_report(report, weights) == report["sent"]


def check_client(report: dict[str, Any]) -> None:
    """With several brokers, the probe must have run the client of several brokers (a
    one-broker client uses one of them only); with one, either client will do."""
    assert brokers() == 1 or report["client"] == "several", report["client"]


def progress(container: Any) -> int:
    """The last ``progress N`` a load probe printed (0 before any)."""
    lines = container.logs(tail=5).decode(errors="replace").splitlines()
    counts = [int(line.split()[1]) for line in lines if line.startswith("progress ")]
    return max(counts, default=0)
