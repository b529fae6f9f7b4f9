"""The model repository's calls and model versions, in both faces of the client.

The waiting rules are tested on the steps alone (``ipuserve.client.repository``: no
I/O); the calls against the fake broker (a real ROUTER) scripted to answer as a
broker with repository workers does, and against a real broker process for what it
answers today. The end-to-end version switch with repository workers is the lead's
(tests of the merged issue 22).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from ipuserve import protocol as wire
from ipuserve.client import Client, RepositoryIndex
from ipuserve.client.config import ClientConfig
from ipuserve.client.repository import (
    Ask,
    Pause,
    Stepper,
    Steps,
    check_version,
    load_steps,
    unload_steps,
)
from ipuserve.errors import (
    DeadlineExceeded,
    InvalidInputError,
    IpuserveError,
    NoRoomError,
    PermissionDeniedError,
    ProtocolError,
    UnavailableError,
    UnknownModelError,
)
from tests.client.faces import MakeClient
from tests.client.fake_broker import (
    FakeBroker,
    ScriptedRepository,
    answered_by,
    inputs,
    scripted_broker,
    state,
)
from tests.helpers import Processes, start_broker, start_worker

FAST = ClientConfig(ping_interval_s=0.05, liveness_s=0.3)


def index(*states: wire.VersionState) -> RepositoryIndex:
    return RepositoryIndex(states)


def walk(steps: Steps, answers: Sequence[RepositoryIndex]) -> tuple[RepositoryIndex, list[Ask]]:
    """Drive ``steps`` with ``answers``, one per Ask, without pausing; the asks made."""
    stepper, asks, queue = Stepper(steps), [], list(answers)
    step = stepper.next(None)
    while step is not None:
        if isinstance(step, Pause):
            assert step.seconds >= 0
            step = stepper.next(None)
        else:
            asks.append(step)
            step = stepper.next(queue.pop(0))
    assert stepper.result is not None and not queue, "every answer taken"
    return stepper.result, asks


LOAD_V2 = Ask("load", "mlp", "2")


# ---------------------------------------------------------------- the rules, no I/O


def test_a_load_waits_past_the_stale_state_and_through_loading_until_ready() -> None:
    answers = [
        index(state("1", "READY", workers=1), state("2", "UNAVAILABLE", "not loaded")),
        index(state("2", "UNAVAILABLE", "not loaded")),  # the hosts have not reported yet
        index(state("2", "LOADING")),
        index(state("2", "READY", workers=1)),
    ]
    last, asks = walk(load_steps(LOAD_V2, wait=True, timeout_s=10), answers)
    assert [a.action for a in asks] == ["load", "index", "index", "index"]
    assert last.find("mlp", "2") == state("2", "READY", workers=1)


def test_a_load_that_names_no_version_waits_for_the_latest_listed() -> None:
    ask = Ask("load", "mlp")
    answers = [
        index(state("1", "READY", workers=1), state("3", "LOADING"), state("2", "UNAVAILABLE")),
        index(state("1", "READY", workers=1), state("3", "READY", workers=1)),
    ]
    last, asks = walk(load_steps(ask, wait=True, timeout_s=10), answers)
    assert len(asks) == 2 and last.find("mlp", "3") is not None


def test_a_load_waits_for_as_many_workers_as_it_asked_for() -> None:
    ask = Ask("load", "mlp", "2", workers=2)
    answers = [
        index(state("2", "LOADING")),
        index(state("2", "READY", workers=1)),
        index(state("2", "READY", workers=2)),
    ]
    _, asks = walk(load_steps(ask, wait=True, timeout_s=10), answers)
    assert len(asks) == 3


def test_a_version_going_unavailable_while_loading_raises_its_reason() -> None:
    answers = [
        index(state("2", "LOADING")),
        index(state("2", "UNAVAILABLE", "popef: truncated file")),
    ]
    with pytest.raises(UnavailableError, match="mlp version 2 did not load: popef: truncated"):
        walk(load_steps(LOAD_V2, wait=True, timeout_s=10), answers)


def test_a_load_without_wait_returns_the_brokers_answer() -> None:
    first = RepositoryIndex((state("2", "UNAVAILABLE", "not loaded"),), "loading mlp 2 on h0")
    last, asks = walk(load_steps(LOAD_V2, wait=False, timeout_s=10), [first])
    assert last == first and asks == [LOAD_V2]


def test_a_wait_past_its_timeout_names_what_it_saw_last() -> None:
    steps = load_steps(LOAD_V2, wait=True, timeout_s=0.05)
    stepper = Stepper(steps)
    step = stepper.next(None)
    with pytest.raises(DeadlineExceeded, match=r"mlp version 2 READY.*version 2 LOADING"):
        while step is not None:
            if isinstance(step, Pause):
                time.sleep(step.seconds)  # the wait itself is what is tested here
                step = stepper.next(None)
            else:
                step = stepper.next(index(state("2", "LOADING")))


def test_an_unload_waits_until_every_hosted_version_is_gone_or_unavailable() -> None:
    ask = Ask("unload", "mlp")
    answers = [
        index(
            state("1", "READY", workers=1),
            state("2", "READY", workers=1),
            state("3", "UNAVAILABLE"),
        ),
        index(state("1", "UNLOADING"), state("2", "UNAVAILABLE", "not loaded")),
        index(state("2", "UNAVAILABLE", "not loaded")),
    ]
    _, asks = walk(unload_steps(ask, wait=True, timeout_s=10), answers)
    assert [a.action for a in asks] == ["unload", "index", "index"]


@pytest.mark.parametrize("given, wire_version", [(None, None), (2, "2"), ("17", "17")])
def test_versions_are_whole_numbers_as_strings(given: object, wire_version: str | None) -> None:
    assert check_version(given) == wire_version


@pytest.mark.parametrize("bad", ["0", "01", "v2", "", 0, -1, 2.0, True, "1" * 19])
def test_a_version_that_is_no_whole_number_is_refused_at_the_call(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="whole number"):
        check_version(bad)


# ---------------------------------------------------------------- through a broker's socket


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    with scripted_broker() as fake:
        yield fake


def test_load_model_sends_the_command_and_waits_until_ready(
    broker: FakeBroker, make_client: MakeClient
) -> None:
    with make_client(broker.address, timeout=10, config=FAST) as client:
        last = client.load_model("mlp", 2, replicas=2, workers=1)
    assert last.find("mlp", "2") == state("2", "READY", workers=1)
    assert last.message == "load done"  # what the command did, not the last poll's ""
    load, *polls = broker.commands
    assert (load.action, load.model, load.version, load.replicas, load.workers) == (
        "load",
        "mlp",
        "2",
        2,
        1,
    )
    assert [p.action for p in polls] == ["index"] * 3


def test_unload_model_and_the_index_through_the_client(
    broker: FakeBroker, make_client: MakeClient
) -> None:
    with make_client(broker.address, timeout=10, config=FAST) as client:
        before = client.repository_index()
        after = client.unload_model("mlp", "1")
    assert [(s.version, s.state) for s in before] == [("1", "READY"), ("2", "UNAVAILABLE")]
    assert after.find("mlp", "1") == state("1", "UNAVAILABLE", "unloaded")
    assert after.message == "unload done"  # done at its answer: nothing polled


@pytest.mark.parametrize(
    "code, error",
    [
        ("PERMISSION_DENIED", PermissionDeniedError),
        ("NO_ROOM", NoRoomError),
        ("UNKNOWN_MODEL", UnknownModelError),
    ],
)
def test_a_refused_command_raises_the_brokers_error_with_its_reason(
    broker: FakeBroker, make_client: MakeClient, code: str, error: type[IpuserveError]
) -> None:
    assert isinstance(broker.repository, ScriptedRepository)
    broker.repository.refusal = wire.ErrorReply(b"", code, f"refused: {code.lower()}")
    with (
        make_client(broker.address, timeout=10, config=FAST) as client,
        pytest.raises(error, match=f"refused: {code.lower()}"),
    ):
        client.load_model("mlp", "2")
    assert len(broker.commands) == 1  # no waiting after a refusal


def test_a_request_naming_a_version_carries_it_and_the_reply_says_which_answered(
    broker: FakeBroker, make_client: MakeClient
) -> None:
    broker.handler = answered_by("2")
    x = inputs(3)
    with make_client(broker.address, timeout=10, config=FAST) as client:
        named = client.infer("add", x, version=2)
        default = client.infer("add", x)
    np.testing.assert_allclose(named["y"], x["a"] + x["b"])
    assert named.version == default.version == "2"
    assert [r.version for r in broker.requests] == ["2", None]


def test_requests_for_other_versions_never_share_a_group(broker: FakeBroker) -> None:
    with Client(broker.address, timeout=10, config=FAST) as client:
        client.models()  # the broker's group advice known
        x = inputs(1)
        futures = [client.infer_async("add", x, version=v) for v in ("1", "2", "1", "2") * 4]
        assert all(f.result(10)["y"].shape == (2, 3) for f in futures)
    for row in broker.rows:
        members = row.members() if row.group else [row]
        assert len({m.version for m in members}) == 1


def test_a_bad_version_or_name_is_refused_before_anything_is_sent(
    broker: FakeBroker, make_client: MakeClient
) -> None:
    with make_client(broker.address, timeout=10, config=FAST) as client:
        with pytest.raises(InvalidInputError, match="whole number"):
            client.infer("add", inputs(), version="latest")
        with pytest.raises(InvalidInputError, match="whole number"):
            client.load_model("mlp", "v2")
        with pytest.raises(InvalidInputError, match="model name"):
            client.unload_model("")
    assert broker.commands == [] and broker.requests == []


# ---------------------------------------------------------------- a real broker


def test_a_real_broker_answers_a_repository_command_at_once(processes: Processes) -> None:
    """A broker answers REPOSITORY with its index, or -- one from before the model
    repository -- with an error naming the command; never with silence (a timeout)."""
    broker = start_broker(processes)
    with Client(broker.frontend, timeout=20, config=FAST) as client:
        try:
            answer = client.repository_index()
        except ProtocolError as exc:
            assert "REPOSITORY" in str(exc)
        else:
            assert isinstance(answer, RepositoryIndex)


def test_a_real_worker_answers_a_request_with_or_without_a_version(processes: Processes) -> None:
    """Through a real broker and worker: the version travels, the result is numpy's,
    and the reply names version "1" (a worker given a model file) once the broker says."""
    broker = start_broker(processes)
    start_worker(processes, broker)
    rng = np.random.default_rng(5)
    x, y = (rng.standard_normal((3, 8)).astype(np.float32) for _ in range(2))
    with Client(broker.frontend, timeout=20, config=FAST) as client:
        for version in (None, "1"):
            outputs = client.infer("add", {"x": x, "y": y}, version=version)
            np.testing.assert_allclose(outputs["z"], x + 2 * y, rtol=1e-6)
            assert outputs.version in (None, "1")
