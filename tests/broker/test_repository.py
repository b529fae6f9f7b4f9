"""The model repository's control plane at a real broker (on a thread), over real sockets.

The repository workers here are *test hosts*: bare DEALERs speaking the worker wire
(HELLO with no models and credit 0, WELCOME, a HOST report; then they receive LOAD and
UNLOAD), standing in for ``ipuserve worker --repository`` (another branch) so the
broker's side is tested on its own. A hosted version's own node is a fake worker with
the id ``HOST/NAME/VERSION``, as a real host's is.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from ipuserve import protocol as wire
from ipuserve.broker.loop import Broker
from ipuserve.security import curve_client, generate_keypair, load_secret_key
from tests.broker.conftest import StartBroker
from tests.broker.fakes import ADD, FakeWorker
from tests.helpers import RawClient, wait_until

ADD2 = wire.ModelSpec("add", ADD.inputs, ADD.outputs, 4, 0, version="2")


@pytest.fixture
def made() -> Iterator[list[FakeWorker]]:
    workers: list[FakeWorker] = []
    yield workers
    for worker in workers:
        worker.close()


def counted(broker: Broker, name: str, **labels: str) -> float:
    """``ipuserve_broker_NAME``'s samples with ``labels``, summed."""
    return broker.metrics.value(f"ipuserve_broker_{name}", **labels)


def host(
    broker: Broker,
    made: list[FakeWorker],
    host_id: str,
    ipus: int,
    free: int,
    entries: tuple[wire.Entry, ...],
    hosted: tuple[wire.Hosted, ...] = (),
    context: zmq.Context[Any] | None = None,
) -> FakeWorker:
    """A test host that joined and reported; the broker has its report on return."""
    fake = FakeWorker(
        broker.backend_endpoint, credit=0, worker_id=host_id, models=(), context=context
    )
    made.append(fake)
    fake.hello()
    fake.send(wire.Host(ipus, free, entries, hosted))
    fake.idle_until(lambda: any(h.worker_id == host_id for h in broker.repository.hosts.values()))
    return fake


def node(broker: Broker, made: list[FakeWorker], host_id: str, spec: wire.ModelSpec) -> None:
    """A hosted version's worker node, registered."""
    fake = FakeWorker(
        broker.backend_endpoint, worker_id=f"{host_id}/{spec.name}/{spec.version}", models=(spec,)
    )
    made.append(fake)
    fake.hello()


def ask(client: RawClient, action: str, model: str | None = None, **options: Any) -> wire.Message:
    """A REPOSITORY command's answer: its RepositoryReply, or the ErrorReply."""
    command = wire.RepositoryCommand(b"c-" + action.encode(), action, model, **options)  # type: ignore[arg-type]
    client.send(command)
    while True:
        message = client.recv()
        if getattr(message, "request_id", None) == command.request_id:
            return message


def index(client: RawClient) -> dict[tuple[str, str], wire.VersionState]:
    reply = ask(client, "index")
    assert isinstance(reply, wire.RepositoryReply), reply
    return {(v.name, v.version): v for v in reply.models}


def refused(reply: wire.Message, code: str) -> str:
    assert isinstance(reply, wire.ErrorReply) and reply.code == code, reply
    return reply.message


ENTRIES = (wire.Entry("add", "1"), wire.Entry("add", "2", replicas=2))


def test_the_index_lists_every_version_with_its_state_reason_workers_and_default(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    broken = wire.Entry("bad", "1", problem="no .popef file in bad/1")
    ready = wire.Hosted("add", "1", "READY", "h1/add/1")
    host(broker, made, "h1", 4, 3, (*ENTRIES, broken), (ready,))
    got = index(client)
    assert got[("add", "1")].state == "LOADING"  # the host says READY; no worker joined yet
    node(broker, made, "h1", ADD)
    got = index(client)
    assert got == {
        ("add", "1"): wire.VersionState("add", "1", "READY", "", ("h1/add/1",), True),
        ("add", "2"): wire.VersionState("add", "2", "UNAVAILABLE", "not loaded"),
        ("bad", "1"): wire.VersionState("bad", "1", "UNAVAILABLE", "no .popef file in bad/1"),
    }
    assert counted(broker, "repository_commands_total", action="index") == 2


def test_an_index_too_big_for_one_reply_is_cut_to_fit_and_says_so(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    """Found by the fuzzer (tests/fuzz/hosts.py): a host's report within the header
    limit made an index whose REPOSITORY_REPLY was over it, which no client can read."""
    entries = tuple(wire.Entry("m" * 200 + str(i), "1") for i in range(1000))
    assert len(wire.Host(4, 4, entries).encode()[1]) <= wire.DEFAULT_LIMITS.max_header_bytes
    host(broker, made, "h1", 4, 4, entries)
    reply = ask(client, "index")  # decoded with the default limits: over them, it raises
    assert isinstance(reply, wire.RepositoryReply), reply
    assert 0 < len(reply.models) < len(entries)
    assert reply.models == index_of(entries)[: len(reply.models)]
    assert f"lists {len(reply.models)} of 1000 versions" in reply.message


def index_of(entries: tuple[wire.Entry, ...]) -> tuple[wire.VersionState, ...]:
    listed = [wire.VersionState(e.name, e.version, "UNAVAILABLE", "not loaded") for e in entries]
    return tuple(sorted(listed, key=lambda v: v.name))


def test_a_load_goes_to_the_least_loaded_host_and_reads_loading_at_once(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    busy = host(broker, made, "a-busy", 4, 2, ENTRIES)
    idle = host(broker, made, "b-idle", 4, 4, ENTRIES)
    reply = ask(client, "load", "add")  # no version: the latest in a repository, 2
    assert isinstance(reply, wire.RepositoryReply), reply
    assert reply.message == "loading model 'add' version 2 on b-idle (2 replica(s))"
    loading = {(v.name, v.version): v.state for v in reply.models}
    assert loading[("add", "2")] == "LOADING"  # before the host reported anything
    assert idle.expect(wire.Load) == wire.Load("add", "2", 2, 1)  # the entry's replicas
    # two workers wanted: the busy host is the one more (the idle one holds it)
    reply = ask(client, "load", "add", version="2", workers=2, replicas=1)
    assert isinstance(reply, wire.RepositoryReply), reply
    assert busy.expect(wire.Load) == wire.Load("add", "2", 1, 2)
    # the idle host's report settles it: LOADING still, until a node of it joins
    idle.send(wire.Host(4, 2, ENTRIES, (wire.Hosted("add", "2", "LOADING", "b-idle/add/2", 2),)))
    idle.idle_until(lambda: not broker.repository.hosts[idle_identity(broker, "b-idle")].loading)
    assert index(client)[("add", "2")].state == "LOADING"
    wait_until(lambda: counted(broker, "loads_sent_total", why="command") == 2)


def idle_identity(broker: Broker, host_id: str) -> bytes:
    return next(k for k, h in broker.repository.hosts.items() if h.worker_id == host_id)


def test_a_load_with_no_room_is_refused_no_room_saying_what_each_host_has(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    host(broker, made, "h1", 4, 1, ENTRIES)
    host(broker, made, "h2", 2, 2, ENTRIES)
    message = refused(ask(client, "load", "add", version="2", workers=2), "NO_ROOM")
    assert message == (
        "model 'add' version 2 wants 2 more worker(s); 1 ha(s) room (h2); the others: "
        "h1: 1 of 4 IPU(s) free, 2 needed"
    )
    assert counted(broker, "repository_refused_total", reason="NO_ROOM") == 1
    assert counted(broker, "errors_total", code="NO_ROOM", model="") == 1


def test_a_load_counts_the_ipus_a_replica_takes_and_the_workers_its_config_wants(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    wide = (wire.Entry("wide", "1", replicas=2, ipus_per_replica=2, workers=2),)
    host(broker, made, "h1", 4, 3, wide)  # 3 free: 2 replicas of 2 IPUs do not fit
    host(broker, made, "h2", 4, 4, wide)
    message = refused(ask(client, "load", "wide"), "NO_ROOM")
    assert message == (
        "model 'wide' version 1 wants 2 more worker(s); 1 ha(s) room (h2); the others: "
        "h1: 3 of 4 IPU(s) free, 4 needed"
    )


def test_unknown_models_and_versions_are_refused_naming_what_there_is(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    host(broker, made, "h1", 4, 4, ENTRIES)
    assert refused(ask(client, "load", "nope"), "UNKNOWN_MODEL").startswith(
        "no worker's repository holds model 'nope' (they hold: add)"
    )
    assert refused(ask(client, "load", "add", version="9"), "UNKNOWN_MODEL") == (
        "no worker's repository holds version 9 of model 'add' (versions: 1, 2)"
    )
    assert refused(ask(client, "unload", "add", version="9"), "UNKNOWN_MODEL") == (
        "no worker holds version 9 of model 'add', and no repository has it (versions: 1, 2)"
    )
    assert counted(broker, "repository_refused_total", reason="UNKNOWN_MODEL") == 3
    reply = ask(client, "unload", "add", version="1")  # known, just not loaded
    assert isinstance(reply, wire.RepositoryReply) and reply.message == (
        "model 'add' version 1 is not loaded"
    )


def test_an_unload_goes_to_every_host_holding_it_and_reads_unloading(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    one = wire.Hosted("add", "1", "READY", "h1/add/1")
    two = wire.Hosted("add", "2", "READY", "h1/add/2", 2)
    h1 = host(broker, made, "h1", 4, 1, ENTRIES, (one, two))
    h2 = host(broker, made, "h2", 4, 3, ENTRIES, (wire.Hosted("add", "1", "READY", "h2/add/1"),))
    node(broker, made, "h1", ADD)
    node(broker, made, "h1", ADD2)
    node(broker, made, "h2", ADD)
    reply = ask(client, "unload", "add", version="1")
    assert isinstance(reply, wire.RepositoryReply), reply
    states = {(v.name, v.version): v for v in reply.models}
    assert states[("add", "1")].state == "UNLOADING" and states[("add", "2")].state == "READY"
    assert states[("add", "2")].default  # the latest with a worker
    assert h1.expect(wire.Unload) == wire.Unload("add", "1")
    assert h2.expect(wire.Unload) == wire.Unload("add", "1")
    # not loaded again where it drains: a host would take that LOAD for a no-op
    assert refused(ask(client, "load", "add", version="1"), "NO_ROOM").endswith(
        "the others: h2: still unloading it; h1: still unloading it"
    )
    h2.send(wire.Host(4, 4, ENTRIES, ()))  # unloaded there; its node left (below)
    h1.send(wire.Host(4, 2, ENTRIES, (two,)))
    for fake in made[2:5:2]:  # the v1 nodes
        fake.send(wire.Bye())
    wait_until(lambda: index(client)[("add", "1")].state == "UNAVAILABLE")
    assert index(client)[("add", "1")].reason == "not loaded"


def test_a_dead_hosts_versions_are_placed_again_on_a_host_with_room(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    context: zmq.Context[Any] = zmq.Context()
    hosted = wire.Hosted("add", "2", "READY", "h1/add/2", replicas=2, wanted_workers=1)
    dying = host(broker, made, "h1", 4, 2, ENTRIES, (hosted,), context=context)
    spare = host(broker, made, "h2", 4, 4, ENTRIES)
    dying.die(context)
    assert spare.expect(wire.Load) == wire.Load("add", "2", 2, 1)
    wait_until(lambda: counted(broker, "loads_sent_total", why="replacement") == 1)  # its thread
    assert index(client)[("add", "2")].state == "LOADING"


def test_a_dead_hosts_version_with_no_room_left_is_unavailable_saying_why(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    context: zmq.Context[Any] = zmq.Context()
    hosted = wire.Hosted("add", "2", "READY", "h1/add/2", replicas=2)
    dying = host(broker, made, "h1", 4, 2, ENTRIES, (hosted,), context=context)
    host(broker, made, "h2", 2, 1, ENTRIES)
    dying.die(context)
    wait_until(lambda: ("add", "2") in broker.repository.lost)
    state = index(client)[("add", "2")]
    assert (state.state, state.reason) == (
        "UNAVAILABLE",
        "its workers left and no worker has room: h2: 1 of 2 IPU(s) free, 2 needed",
    )


def test_a_client_key_is_refused_permission_denied_and_an_admin_key_is_answered(
    start_broker_thread: StartBroker, tmp_path: Path
) -> None:
    """With keys, roles are the allow-lists' (in protected mode every loopback client is
    an admin, so this needs keys)."""
    dirs = {role: tmp_path / role for role in ("clients", "workers", "admins")}
    for folder in dirs.values():
        folder.mkdir()
    server = generate_keypair("broker", tmp_path)
    pairs = {}
    for role, folder in (("client", dirs["clients"]), ("admin", dirs["admins"])):
        files = generate_keypair(role, tmp_path)
        (folder / files.public.name).write_bytes(files.public.read_bytes())
        pairs[role] = load_secret_key(files.secret)
    broker = start_broker_thread(
        curve_secret_key=str(server.secret),
        client_keys=str(dirs["clients"]),
        worker_keys=str(dirs["workers"]),
        admin_keys=str(dirs["admins"]),
    )
    context: zmq.Context[Any] = zmq.Context()
    try:
        answers = {}
        for role, pair in pairs.items():
            sock = context.socket(zmq.DEALER)
            curve_client(sock, pair, server.public)
            sock.connect(broker.frontend_endpoint)
            sock.send_multipart(wire.RepositoryCommand(b"i", "index").encode())  # type: ignore[arg-type]
            assert sock.poll(10_000), f"the {role} got no answer"
            answers[role] = wire.decode(sock.recv_multipart(copy=False))
            sock.close(linger=0)
    finally:
        context.destroy(linger=0)
    message = refused(answers["client"], "PERMISSION_DENIED")
    assert "needs the admin role" in message
    assert isinstance(answers["admin"], wire.RepositoryReply)
    assert counted(broker, "repository_refused_total", reason="PERMISSION_DENIED") == 1


def test_two_brokers_place_a_dead_hosts_version_on_the_same_host(
    start_broker_thread: StartBroker, made: list[FakeWorker]
) -> None:
    """Each broker decides from the hosts' reports alone; the same reports and the same
    rule (least loaded, then by id) make them pick the same host, without talking."""
    brokers = [start_broker_thread(), start_broker_thread()]
    context: zmq.Context[Any] = zmq.Context()
    hosted = wire.Hosted("add", "1", "READY", "h1/add/1")
    for broker in brokers:  # a host joins every broker, each with a connection of its own
        host(broker, made, "h1", 2, 1, ENTRIES, (hosted,), context=context)
        host(broker, made, "h3", 4, 4, ENTRIES)
        host(broker, made, "h2", 4, 4, ENTRIES)  # as idle as h3: the id decides
    made[0].alive = made[3].alive = False
    context.destroy(linger=0)  # h1 dies: both its connections close

    def loading(broker: Broker) -> dict[str, set[tuple[str, str]]]:
        return {h.worker_id: set(h.loading) for h in broker.repository.hosts.values()}

    for broker in brokers:
        wait_until(lambda b=broker: loading(b).get("h2") == {("add", "1")})  # type: ignore[misc]
        assert loading(broker) == {"h2": {("add", "1")}, "h3": set()}


def test_a_load_whose_host_dies_before_reporting_it_is_placed_again(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    """The caller waits for READY by asking the index: a LOAD lost with its host must
    not leave the version "not loaded" (the caller would give up) but go elsewhere."""
    context: zmq.Context[Any] = zmq.Context()
    first = host(broker, made, "a", 4, 4, ENTRIES, context=context)
    second = host(broker, made, "b", 4, 3, ENTRIES)
    assert isinstance(ask(client, "load", "add", version="1", workers=1), wire.RepositoryReply)
    assert first.expect(wire.Load) == wire.Load("add", "1", 1, 1)
    first.die(context)  # before its report says anything of it
    assert second.expect(wire.Load) == wire.Load("add", "1", 1, 1)
    assert index(client)[("add", "1")].state == "LOADING"


@pytest.mark.parametrize("kept", [True, False])
def test_a_host_back_under_its_id_loses_only_what_its_next_report_lacks(
    start_broker_thread: StartBroker, made: list[FakeWorker], kept: bool
) -> None:
    """A host registering again on a new connection (its old one gone) reconnected (it
    still hosts its versions) or restarted (it hosts nothing): its next report says
    which, and only what it lost is placed again."""
    broker = start_broker_thread(heartbeat_ms=5000, liveness_ms=20_000)  # no beat between
    context: zmq.Context[Any] = zmq.Context()
    hosted = wire.Hosted("add", "1", "READY", "h1/add/1")
    old = host(broker, made, "h1", 4, 3, ENTRIES, (hosted,), context=context)
    host(broker, made, "h2", 4, 4, ENTRIES)
    old.alive = False
    context.destroy(linger=0)
    again = host(broker, made, "h1", 4, 3 if kept else 4, ENTRIES, (hosted,) if kept else ())
    assert counted(broker, "workers_lost_total", reason="restarted") == 1
    views = {h.worker_id: h for h in broker.repository.hosts.values()}
    assert broker.registry.workers[views["h1"].worker.identity] is views["h1"].worker
    if kept:  # decided when h1's report came: nothing lost, nothing loaded
        assert views["h1"].loading == views["h2"].loading == {}
    else:  # on the least loaded: h1 itself (empty now; ties go by id)
        assert again.expect(wire.Load) == wire.Load("add", "1", 1, 1)
        assert views["h2"].loading == {}


def test_a_draining_default_version_hands_its_queue_and_new_requests_to_another(
    broker: Broker, client: RawClient, made: list[FakeWorker]
) -> None:
    """v2 (the latest: the default) starts draining (credit 0, as an unload or SIGTERM
    does): requests naming no version queued for it go to v1 at once, not when v2
    finally leaves, and so do new ones; the job v2 runs is still its to answer."""
    v1 = FakeWorker(broker.backend_endpoint, worker_id="v1", models=(ADD,), credit=4)
    v2 = FakeWorker(broker.backend_endpoint, worker_id="v2", models=(ADD2,), credit=1)
    made += [v1, v2]
    v1.hello()
    v2.hello()
    inputs = {"x": np.ones((4, 8), np.float32), "y": np.ones((4, 8), np.float32)}
    ids = [client.request("add", inputs) for _ in range(3)]
    running = v2.job()
    v2.idle_until(lambda: broker.dispatcher.queues[("add", "2")].head() is not None)
    v2.send(wire.Heartbeat(credit=0))
    moved = [v1.job(), v1.job()]
    assert [job.version for job in (running, *moved)] == ["2", "1", "1"]
    assert broker.registry.defaults["add"] == ("add", "1")
    v2.answer(running)
    v1.answer(*moved)
    replies = {}
    for _ in ids:
        reply = client.recv()
        assert isinstance(reply, wire.Reply), reply
        replies[reply.request_id] = reply.version
    assert sorted(replies.values()) == ["1", "1", "2"]
