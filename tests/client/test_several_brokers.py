"""A client with several brokers: spreading, failover with the same ids, coming back.

Real processes on loopback: two brokers, each with its own ``add`` worker (tests/
fn_worker.py), and one :class:`Client` given both frontends. Every result is checked
against numpy, and every request is settled exactly once (its future's one result).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

from ipuserve import protocol as wire
from ipuserve.client import Client, ClientConfig
from ipuserve.client import base as client_base
from ipuserve.client.cli import client_address
from ipuserve.client.core import least_loaded
from ipuserve.client.fleet import FleetWorker, merge_models
from ipuserve.discovery import EndpointSet, expand
from ipuserve.errors import ConfigError, DeadlineExceeded, UnknownModelError
from ipuserve.face.cli import main
from tests.client import fake_broker
from tests.client.faces import Face, MakeClient
from tests.client.fake_broker import FakeBroker, add_handler
from tests.client.fake_broker import inputs as fake_inputs
from tests.helpers import (
    BrokerProc,
    Processes,
    add_expected,
    add_inputs,
    metric,
    restart_broker,
    scrape,
    start_broker,
    start_worker,
    wait_until,
)

#: a short liveness window: a silent broker is noticed quickly
CONFIG = ClientConfig(ping_interval_s=0.1, liveness_s=0.5, reconnect_max_s=0.1)
#: where a test needs a broker still "usable" a moment after it stopped answering, or
#: bounds the gap without a result after kill -9 by the window: one a loaded 2-core
#: machine keeps (a failover by silence, not by the lost connection, takes longer)
ROOMY_CONFIG = ClientConfig(ping_interval_s=0.2, liveness_s=2.0, reconnect_max_s=0.1)


def accepted(broker: BrokerProc) -> float:
    """Requests the broker accepted, from its metrics."""
    return metric(scrape(broker.metrics_url), "ipuserve_broker_requests_total")


@pytest.fixture
def two_brokers(processes: Processes) -> tuple[BrokerProc, BrokerProc]:
    brokers = (start_broker(processes), start_broker(processes))
    for broker in brokers:
        start_worker(processes, broker)
    return brokers


def check(outputs: dict[str, Any], inputs: dict[str, Any]) -> None:
    np.testing.assert_allclose(outputs["z"], add_expected(inputs), rtol=1e-6)


def usable_links(client: Face) -> int:
    return sum(link.usable for link in client.links())


def test_requests_spread_over_both_brokers(two_brokers: tuple[BrokerProc, BrokerProc]) -> None:
    first, second = two_brokers
    with Client([first.frontend, second.frontend], timeout=20, config=ROOMY_CONFIG) as client:
        wait_until(lambda: usable_links(client) == 2)
        for i in range(40):  # one at a time: the round-robin among equals spreads them
            inputs = add_inputs(1 + i % 3, seed=i)
            check(client.infer("add", inputs), inputs)
        # one at a time, they left from this thread (the sockets free), as with one broker
        assert client.stats.direct > 0
        futures = [client.infer_async("add", add_inputs(2, seed=i)) for i in range(200)]
        for i, future in enumerate(futures):
            check(future.result(20), add_inputs(2, seed=i))
        assert client.stats.replies == 240
        assert client.stats.dropped_replies == 0
    counts = accepted(first), accepted(second)
    assert sum(counts) == 240
    assert min(counts) >= 40, counts  # neither broker was left out


def test_kill_one_broker_under_load_nothing_lost_nothing_twice(
    processes: Processes, two_brokers: tuple[BrokerProc, BrokerProc], make_client: MakeClient
) -> None:
    first, second = two_brokers
    per_thread, threads = 150, 4
    settled: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()
    failures: list[BaseException] = []
    progress = threading.Semaphore(0)
    times: list[float] = []

    def load(client: Face, seed: int) -> None:
        try:
            for i in range(per_thread):
                inputs = add_inputs(1 + i % 4, seed=seed * 1000 + i)
                future = client.infer_async("add", inputs)
                check(future.result(30), inputs)
                with lock:
                    settled[seed, i] += 1
                    times.append(time.monotonic())
                progress.release()
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    frontends = [first.frontend, second.frontend]
    with make_client(frontends, timeout=30, config=ROOMY_CONFIG) as client:
        wait_until(lambda: usable_links(client) == 2)
        workers = [threading.Thread(target=load, args=(client, s)) for s in range(threads)]
        for thread in workers:
            thread.start()
        for _ in range(threads * per_thread // 4):  # a quarter done: kill one broker
            assert progress.acquire(timeout=30)
        killed_at = time.monotonic()
        first.proc.kill()
        for thread in workers:
            thread.join(60)
        assert not failures, failures
        after = [t for t in times if t >= killed_at]
        gaps = np.diff([killed_at, *after])
        # the killed broker's requests went to the other at once (its connection
        # dropped), well within the liveness window
        assert client.stats.failovers >= 1
        assert gaps.max() < ROOMY_CONFIG.liveness_s, gaps.max()
        assert len(settled) == threads * per_thread
        assert set(settled.values()) == {1}
        stats = client.stats
        assert stats.replies == threads * per_thread
        # restarted, the broker gets new requests again
        first = restart_broker(processes, first)
        start_worker(processes, first)
        wait_until(lambda: usable_links(client) == 2, timeout=20)
        futures = [client.infer_async("add", add_inputs(1, seed=i)) for i in range(100)]
        for i, future in enumerate(futures):
            check(future.result(20), add_inputs(1, seed=i))
    assert accepted(first) > 0  # the new broker took part of the load again


def test_broker_silent_then_requests_move_with_the_same_ids(
    two_brokers: tuple[BrokerProc, BrokerProc], make_client: MakeClient
) -> None:
    """SIGSTOP one broker: its connection stays up, it just stops answering. Its
    pending requests go to the other broker after the liveness window; when it is
    resumed it answers them too, and those second replies are dropped."""
    first, second = two_brokers
    frontends = [first.frontend, second.frontend]
    with make_client(frontends, timeout=20, config=ROOMY_CONFIG) as client:
        wait_until(lambda: usable_links(client) == 2)
        first.proc.popen.send_signal(19)  # SIGSTOP
        try:
            futures = [client.infer_async("add", add_inputs(1, seed=i)) for i in range(50)]
            for i, future in enumerate(futures):
                check(future.result(20), add_inputs(1, seed=i))
        finally:
            first.proc.popen.send_signal(18)  # SIGCONT
        moved = client.stats.failovers
        assert moved > 0  # some had gone to the stopped broker before it fell silent
        wait_until(lambda: client.stats.dropped_replies >= 1, timeout=20)
        assert client.stats.replies == 50


def test_a_duplicate_reply_settles_once(make_client: MakeClient) -> None:
    """Broker A falls silent holding a request; the client moves it to B, which
    answers; then A answers it too (the same id from two brokers): dropped, counted,
    and the future keeps B's one result."""
    a, b = FakeBroker().start(), FakeBroker().start()
    try:
        with make_client([a.address, b.address], timeout=20, config=ROOMY_CONFIG) as client:
            wait_until(lambda: usable_links(client) == 2)
            a.silent = True
            both = [client.infer_async("add", fake_inputs(seed)) for seed in (1, 2)]
            for seed, future in zip((1, 2), both, strict=True):
                x = fake_inputs(seed)
                np.testing.assert_allclose(future.result(20)["y"], x["a"] + x["b"], rtol=1e-6)
            assert client.stats.failovers == 1
            (held,) = a.requests  # the one that went to A first
            b_answers = [r.request_id for r in b.requests]
            assert b_answers.count(held.request_id) == 1  # moved with the same id
            before = client.stats.replies
            a.send_raw(add_handler(held).encode())
            wait_until(lambda: client.stats.dropped_replies == 1)
            assert client.stats.replies == before
    finally:
        a.stop()
        b.stop()


# ---------------------------------------------------------------- the commands


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_models_with_two_brokers_shows_each_model_once(
    two_brokers: tuple[BrokerProc, BrokerProc],
) -> None:
    first, second = two_brokers
    listed = json.loads(
        invoke("models", "--broker", first.frontend, "--broker", second.frontend, "--json").stdout
    )
    assert [model["spec"]["name"] for model in listed] == ["add"]
    (add,) = listed
    assert sorted(add["brokers"]) == sorted([first.frontend, second.frontend])
    workers = add["workers"]
    assert len(workers) == 2 == len({w["worker_id"] for w in workers})  # one per broker
    assert sorted(b for w in workers for b in w["brokers"]) == sorted(add["brokers"])
    table = invoke("models", "--broker", first.frontend, "--broker", second.frontend).stdout
    assert sum(line.startswith("add ") for line in table.splitlines()) == 1
    for worker in workers:
        assert f"brokers {worker['brokers'][0]}" in table


def test_models_names_a_broker_that_does_not_answer(
    two_brokers: tuple[BrokerProc, BrokerProc],
) -> None:
    first, _ = two_brokers
    silent = FakeBroker().start()
    silent.silent = True
    try:
        args = ["models", "--broker", first.frontend, "--broker", silent.address]
        result = invoke(*args, "--json", "--timeout-s", "1")
    finally:
        silent.stop()
    assert [model["spec"]["name"] for model in json.loads(result.stdout)] == ["add"]
    assert f"warning: {silent.address}: [DEADLINE_EXCEEDED]" in result.stderr


def test_infer_takes_the_brokers_from_the_variable_space_separated(
    two_brokers: tuple[BrokerProc, BrokerProc], tmp_path: Path
) -> None:
    first, second = two_brokers
    given = add_inputs(rows=3, seed=7)
    for name, array in given.items():
        np.save(tmp_path / f"{name}.npy", array)
    out = tmp_path / "out.npz"
    env = {"IPUSERVE_INFER_BROKER": f"{first.frontend} {second.frontend}"}
    invoke(
        "infer", "--model", "add", "--input", f"x={tmp_path / 'x.npy'}",
        "--input", f"y={tmp_path / 'y.npy'}", "--output", str(out), env=env,
    )  # fmt: skip
    with np.load(out) as saved:
        np.testing.assert_allclose(saved["z"], add_expected(given), rtol=1e-6)


def test_bench_spreads_its_load_over_two_brokers(
    two_brokers: tuple[BrokerProc, BrokerProc],
) -> None:
    first, second = two_brokers
    args = ["bench", "--broker", first.frontend, "--broker", second.frontend, "--model", "add"]
    result = invoke(*args, "--concurrency", "4", "--requests", "200", "--warmup-s", "0", "--json")
    summary = json.loads(result.stdout)
    assert summary["ok"] == summary["requests"] == 200, summary
    assert accepted(first) > 0 and accepted(second) > 0


# ---------------------------------------------------------------- pure logic


def test_least_loaded_takes_the_smallest_and_turns_among_equals() -> None:
    assert least_loaded([3, 1, 2], 0) == 1
    assert least_loaded([3, 1, 2], 2) == 1
    assert [least_loaded([0, 0, 0], turn) for turn in range(4)] == [0, 1, 2, 0]
    assert least_loaded([1, 0, 0], 2) == 2
    assert least_loaded([5], 7) == 0


def test_merge_models_shows_each_model_and_worker_once() -> None:
    spec = fake_broker.ADD
    shared = wire.WorkerLoad("w1", credit=4, in_flight=1, requests=2)
    a = [wire.ModelInfo(spec, 3, (shared, wire.WorkerLoad("w2", 8, 0, 0)))]
    b = [wire.ModelInfo(spec, 1, (wire.WorkerLoad("w1", 4, 2, 5),))]
    (model,) = merge_models({"tcp://a:1": a, "tcp://b:1": b})
    assert model.brokers == ("tcp://a:1", "tcp://b:1")
    assert model.queued == 4
    assert model.workers == (
        FleetWorker("w1", 8, 3, 7, ("tcp://a:1", "tcp://b:1")),
        FleetWorker("w2", 8, 0, 0, ("tcp://a:1",)),
    )
    assert model.info().workers[0] == wire.WorkerLoad("w1", 8, 3, 7)


def test_one_broker_keeps_the_single_socket_client() -> None:
    assert client_address(("tcp://127.0.0.1:5555",)) == "tcp://127.0.0.1:5555"
    assert client_address(["tcp://127.0.0.1:5555 tcp://127.0.0.2:5555"]) == [
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.2:5555",
    ]
    fixed = "tcp://127.0.0.1:5555"
    with Client(fixed) as one, Client([fixed]) as listed, Client(["tcp://localhost:5555"]) as name:
        assert not one._io.follows and len(one._io.core.links) == 1
        assert not listed._io.follows  # nothing to follow: the one socket
        assert name._io.follows  # a name, followed as it changes
        assert [link.endpoint for link in listed.links()] == [fixed]
        assert [link.endpoint for link in name.links()] == ["tcp://localhost:5555"]


def test_a_client_refuses_an_empty_or_bad_list_of_endpoints() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        Client([])
    with pytest.raises(ConfigError):
        Client(["tcp://127.0.0.1:5555", "nonsense"])


def test_a_name_with_several_addresses_is_one_link_each_followed_as_it_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``tcp://NAME:PORT`` resolving to two addresses: a link to each. When the name
    resolves to one address again it is used as the name (ipuserve.discovery's
    rule: ZeroMQ re-resolves it), and the removed links' pending requests move to
    that link, with their ids."""
    a = FakeBroker().start()
    port = a.address.rsplit(":", 1)[1]
    b = FakeBroker(address=f"tcp://127.0.0.2:{port}").start()
    addresses = ["127.0.0.1", "127.0.0.2"]
    follow = partial(EndpointSet, resolver=lambda _host: list(addresses), interval_s=0.05)
    monkeypatch.setattr(client_base, "EndpointSet", follow)
    try:
        with Client([f"tcp://localhost:{port}"], timeout=20, config=ROOMY_CONFIG) as client:
            wait_until(lambda: usable_links(client) == 2)
            assert sorted(link.endpoint for link in client.links()) == [a.address, b.address]
            for seed in range(10):
                x = fake_inputs(seed)
                y = client.infer("add", x)["y"]
                np.testing.assert_allclose(y, x["a"] + x["b"], rtol=1e-6)
            assert a.requests and b.requests  # both addresses served
            b.silent = True
            seen = len(b.requests)
            both = [client.infer_async("add", fake_inputs(seed)) for seed in (1, 2)]
            wait_until(lambda: len(b.requests) == seen + 1)  # one of the two went to b
            held = b.requests[-1].request_id
            addresses.remove("127.0.0.2")
            for seed, future in zip((1, 2), both, strict=True):
                x = fake_inputs(seed)
                np.testing.assert_allclose(future.result(20)["y"], x["a"] + x["b"], rtol=1e-6)
            assert [link.endpoint for link in client.links()] == [f"tcp://localhost:{port}"]
            assert held in [r.request_id for r in a.requests]
            assert client.stats.failovers >= 1
    finally:
        a.stop()
        b.stop()


def test_a_string_naming_several_brokers_is_taken_as_a_list_of_that_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Client("tcp://tasks.broker:5555")``: a plain string whose host resolves to two
    addresses when the client starts gets a link to each, as the CLI's --broker does."""
    a = FakeBroker().start()
    port = a.address.rsplit(":", 1)[1]
    b = FakeBroker(address=f"tcp://127.0.0.2:{port}").start()

    def table(_host: str) -> list[str]:
        return ["127.0.0.1", "127.0.0.2"]

    monkeypatch.setattr(client_base, "EndpointSet", partial(EndpointSet, resolver=table))
    monkeypatch.setattr(client_base, "expand", partial(expand, resolver=table))
    try:
        with Client(f"tcp://localhost:{port}", timeout=20, config=ROOMY_CONFIG) as client:
            wait_until(lambda: usable_links(client) == 2)
            assert sorted(link.endpoint for link in client.links()) == [a.address, b.address]
    finally:
        a.stop()
        b.stop()


def test_a_slow_resolver_does_not_stall_the_replies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-resolving runs off the I/O thread: while a lookup hangs, requests to the
    brokers already known are still sent and answered (in the swarm test, a lookup on
    the I/O thread after a broker task died stopped every reply for 2.9 s)."""
    a = FakeBroker().start()
    port = a.address.rsplit(":", 1)[1]
    b = FakeBroker(address=f"tcp://127.0.0.2:{port}").start()
    hang = threading.Event()
    lookups: list[str] = []

    def table(host: str) -> list[str]:
        lookups.append(host)
        if len(lookups) > 1:
            hang.wait(30)  # every re-resolution hangs until the test ends
        return ["127.0.0.1", "127.0.0.2"]

    follow = partial(EndpointSet, resolver=table, interval_s=0.05)
    monkeypatch.setattr(client_base, "EndpointSet", follow)
    try:
        with Client([f"tcp://localhost:{port}"], timeout=5, config=ROOMY_CONFIG) as client:
            wait_until(lambda: usable_links(client) == 2 and len(lookups) >= 2)
            for seed in range(20):  # a lookup is hanging all along
                x = fake_inputs(seed)
                np.testing.assert_allclose(client.infer("add", x)["y"], x["a"] + x["b"])
            assert a.requests and b.requests
            hang.set()
    finally:
        hang.set()
        a.stop()
        b.stop()


def test_a_frontend_with_no_broker_is_left_out_and_none_at_all_times_out() -> None:
    """One of two frontends has no broker: every request goes to the other. With
    neither, a request waits unsent and fails at its own deadline, saying so."""
    b = FakeBroker().start()
    nobody = FakeBroker().start()
    nobody.stop()  # its port, with nobody listening
    port = nobody.address.rsplit(":", 1)[1]
    try:
        with Client([nobody.address, b.address], timeout=20, config=CONFIG) as client:
            for seed in range(5):
                x = fake_inputs(seed)
                np.testing.assert_allclose(client.infer("add", x)["y"], x["a"] + x["b"])
            assert len(b.requests) == 5
            assert [link.usable for link in client.links()] == [False, True]
        with (
            Client(
                [nobody.address, f"tcp://127.0.0.2:{port}"], timeout=0.3, config=CONFIG
            ) as client,
            pytest.raises(DeadlineExceeded, match="nothing has answered"),
        ):
            client.infer("add", fake_inputs())
    finally:
        b.stop()


def test_a_broker_shutting_down_hands_its_requests_to_the_other() -> None:
    """BROKER_SHUTDOWN keeps a request pending (as with one broker); with another
    broker usable it goes there at once, same id, instead of waiting."""
    stopping = FakeBroker(
        lambda r: wire.ErrorReply(r.request_id, "BROKER_SHUTDOWN", "stopping")
    ).start()
    b = FakeBroker().start()
    try:
        # a roomy liveness window: under load a 0.5 s one let a busy link look silent,
        # and its requests' move counted as one more failover (the full suite, once)
        with Client([stopping.address, b.address], timeout=20, config=ROOMY_CONFIG) as client:
            wait_until(lambda: usable_links(client) == 2)
            futures = [client.infer_async("add", fake_inputs(seed)) for seed in range(4)]
            for seed, future in enumerate(futures):
                x = fake_inputs(seed)
                np.testing.assert_allclose(future.result(20)["y"], x["a"] + x["b"])
            refused = {r.request_id for r in stopping.requests}
            assert refused and refused <= {r.request_id for r in b.requests}
            assert client.stats.held_over_shutdown == len(refused)
            # every refused request moved; so may one given to the stopping broker in the
            # turn its BROKER_SHUTDOWN arrived, before it left (it never reached it)
            assert len(refused) <= client.stats.failovers <= len(futures)
    finally:
        stopping.stop()
        b.stop()


def unknown_model_answers(broker: BrokerProc) -> float:
    """UNKNOWN_MODEL answers the broker sent, from its metrics (under model="": it
    labels only the models it serves)."""
    samples = scrape(broker.metrics_url)
    return sum(
        value
        for key, value in samples.items()
        if key.startswith("ipuserve_broker_errors_total{") and 'code="UNKNOWN_MODEL"' in key
    )


def test_a_model_one_broker_does_not_serve_is_asked_of_the_other_and_it_once(
    processes: Processes,
) -> None:
    """UNKNOWN_MODEL from one broker is not the fleet's answer (a restarted broker
    whose workers are not back yet says it too): the request goes to a broker that
    has not said so, and fails only when every usable one has. The client remembers
    it: the broker lacking the model is not asked for it again (one round trip lost,
    not one per request) until its model list shows the model."""
    serving, empty = start_broker(processes), start_broker(processes)
    start_worker(processes, serving)  # `add`, at the first broker only
    with Client([serving.frontend, empty.frontend], timeout=20, config=ROOMY_CONFIG) as client:
        wait_until(lambda: usable_links(client) == 2)
        for i in range(20):
            inputs = add_inputs(1 + i % 3, seed=i)
            check(client.infer("add", inputs), inputs)
        assert client.stats.unknown_model_retries <= 1  # the first, if it went there
        assert unknown_model_answers(empty) == client.stats.unknown_model_retries
        assert accepted(serving) == 20  # (a refused request is not counted as accepted)
        with pytest.raises(UnknownModelError, match="nope"):
            client.infer("nope", add_inputs(1))

        # `empty` gains the model; once its MODELS_REPLY lists it, it is asked again
        start_worker(processes, empty)
        by_broker = client.models_by_broker()
        assert [m.spec.name for m in by_broker[empty.frontend]] == ["add"]  # type: ignore[union-attr]
        for i in range(20):
            inputs = add_inputs(1 + i % 3, seed=100 + i)
            check(client.infer("add", inputs), inputs)
    assert accepted(empty) > 0
    assert accepted(serving) + accepted(empty) == 40
