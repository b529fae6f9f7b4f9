"""What workers announce is bounded (issue 16): the broker never forgot a model name
and answered MODELS in one MODELS_REPLY, so after ~1,240 names (five HELLOs of 400
models) its header passed the 256 KiB limit and `ipuserve models` failed for everyone.
Now models are refused at HELLO (WELCOME's ``refused``, with why) past the bounds,
orphans are forgotten when room is needed, and MODELS_REPLY always fits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from ipuserve import protocol as wire
from ipuserve.broker.loop import Broker
from ipuserve.broker.registry import MAX_MODELS, MAX_WORKER_MODELS
from tests.broker.conftest import StartBroker
from tests.broker.fakes import ADD, FakeWorker
from tests.helpers import RawClient, add_inputs, assert_add_reply, wait_until


def models(prefix: str, count: int) -> tuple[wire.ModelSpec, ...]:
    return tuple(
        wire.ModelSpec(f"{prefix}{n}", ADD.inputs, ADD.outputs, ADD.batch_size, 0)
        for n in range(count)
    )


@pytest.fixture
def made() -> Iterator[list[FakeWorker]]:
    workers: list[FakeWorker] = []
    yield workers
    for worker in workers:
        worker.close()


def join(broker: Broker, made: list[FakeWorker], **options: Any) -> FakeWorker:
    worker = FakeWorker(broker.backend_endpoint, **options)
    made.append(worker)
    worker.hello()
    return worker


def listed(client: RawClient) -> dict[str, int]:
    """model -> its workers, from a MODELS_REPLY the client could decode."""
    return {info.spec.name: len(info.workers) for info in client.models()}


def test_five_hellos_of_400_models_leave_models_answerable(
    start_broker_thread: StartBroker, made: list[FakeWorker]
) -> None:
    broker = start_broker_thread()
    full = MAX_MODELS // MAX_WORKER_MODELS  # workers whose first 64 models are taken
    for n in range(5):
        worker = join(broker, made, worker_id=f"w{n}", models=models(f"w{n}-model-", 400))
        assert worker.welcome is not None
        refused = dict(worker.welcome.refused)
        if n < full:
            assert len(refused) == 400 - MAX_WORKER_MODELS
            assert f"at most {MAX_WORKER_MODELS} models" in refused[f"w{n}-model-399"]
        else:  # the broker knows as many names as it may
            assert len(refused) == 400
            assert f"knows {MAX_MODELS} model versions" in refused[f"w{n}-model-0"]
    with RawClient(broker.frontend_endpoint) as client:
        known = listed(client)  # its header passed 256 KiB: BAD_MESSAGE for everyone
    assert len(known) == MAX_MODELS


def test_the_broker_knows_at_most_max_models_and_forgets_orphans_for_new_ones(
    start_broker_thread: StartBroker, made: list[FakeWorker]
) -> None:
    broker = start_broker_thread(orphan_ms=0)
    per = MAX_WORKER_MODELS
    olds = [
        join(broker, made, worker_id=f"old{n}", models=models(f"old{n}-", per))
        for n in range(MAX_MODELS // per)
    ]
    late = join(broker, made, worker_id="late", models=(ADD,))
    assert late.welcome is not None and late.welcome.refused  # the 257th name
    assert f"knows {MAX_MODELS} model versions" in late.welcome.refused[0][1]
    for old in olds:
        old.send(wire.Bye())
    with RawClient(broker.frontend_endpoint) as client:
        wait_until(lambda: not any(listed(client).values()))  # every old one orphaned
        again = join(broker, made, worker_id="again", models=(ADD,))
        assert again.welcome is not None and again.welcome.refused == ()
        assert listed(client) == {"add": 1}  # the orphans are forgotten, names and all
        inputs = add_inputs(2)
        request_id = client.request("add", inputs)
        again.answer(again.job())
        reply = client.recv()
    assert isinstance(reply, wire.Reply) and reply.request_id == request_id
    assert_add_reply(reply, inputs)


def test_workers_with_long_ids_cannot_push_models_reply_past_the_header_limit(
    start_broker_thread: StartBroker, made: list[FakeWorker]
) -> None:
    """Each (worker, model) is an entry of MODELS_REPLY: 256 characters of worker id
    outside the BMP are 1 KiB of JSON (UTF-8, 4 bytes each), 64 models 64 KiB a worker."""
    broker = start_broker_thread()
    served = models("m", MAX_WORKER_MODELS)
    refusals: list[str] = []
    for n in range(5):
        worker = join(broker, made, worker_id=f"{n}" + "\U0001f600" * 255, models=served)
        assert worker.welcome is not None
        refusals += [why for _name, why in worker.welcome.refused]
    assert refusals and all("MODELS reply would pass" in why for why in refusals)
    with RawClient(broker.frontend_endpoint) as client:
        known = listed(client)
        frames = _models_frames(client)
    assert set(known) == {spec.name for spec in served}
    assert len(frames[1]) <= wire.DEFAULT_LIMITS.max_header_bytes


def _models_frames(client: RawClient) -> list[bytes]:
    client.send(wire.ListModels(b"raw"))
    assert client.socket.poll(10_000, zmq.POLLIN)
    frames: list[bytes] = client.socket.recv_multipart()
    return frames
