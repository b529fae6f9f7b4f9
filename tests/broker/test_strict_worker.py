"""The broker checks what a worker sends as strictly as what a client sends (issue 16):
a worker's result or failure, however it is formed, never makes the broker send a
client a reply it refuses, a code that keeps it waiting, or another request's rows.

An in-process broker, a raw DEALER client and a fake worker, on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ipuserve import protocol as wire
from ipuserve.broker.loop import Broker
from tests.broker.fakes import FakeWorker, result_for
from tests.helpers import RawClient, add_inputs, assert_add_reply

INPUTS = add_inputs(2)
#: as many timing entries as the wire allows (docs/protocol.md: at most 32)
FULL_TIMING = {f"t{n}_us": float(n) for n in range(wire.MAX_TIMING_KEYS)}


@pytest.fixture
def worker(broker: Broker) -> Iterator[FakeWorker]:
    fake = FakeWorker(broker.backend_endpoint)
    fake.hello()
    yield fake
    fake.close()


def full_timing(job: wire.Job) -> wire.Result:
    result = result_for(job)
    return wire.Result(job.job_id, result.tensors, FULL_TIMING)


def assert_error(message: wire.Message, request_id: bytes, code: str) -> None:
    assert isinstance(message, wire.ErrorReply), message
    assert (message.request_id, message.code) == (request_id, code), message


def test_a_result_with_the_most_timing_entries_reaches_a_client_of_single_requests(
    client: RawClient, worker: FakeWorker
) -> None:
    """One result in a RESULTS: the fast path's timing text, passed on to the REPLY."""
    request_id = client.request("add", INPUTS)
    worker.send(wire.Results((full_timing(worker.job()),)))
    reply = client.recv()  # the client's decoder refused 33 entries
    assert isinstance(reply, wire.Reply) and reply.request_id == request_id
    assert_add_reply(reply, INPUTS)
    assert len(reply.timing) == wire.MAX_TIMING_KEYS and "broker_queue_us" in reply.timing


def test_results_with_the_most_timing_entries_reach_a_batching_client(
    client: RawClient, worker: FakeWorker
) -> None:
    """Two results in one RESULTS (the full decoder), their replies in one REPLIES."""
    inputs = [add_inputs(2, seed) for seed in (1, 2)]
    rows = tuple(
        wire.Request(b"b%d" % n, "add", wire.Tensors.of(arrays)) for n, arrays in enumerate(inputs)
    )
    client.send(wire.Requests(rows))
    batch = worker.next_batch()
    assert len(batch.jobs) == 2
    worker.send(wire.Results(tuple(full_timing(job) for job in batch.jobs)))
    replies = client.recv()
    assert isinstance(replies, wire.Replies) and not replies.errors
    by_id = {reply.request_id: reply for reply in replies.replies}
    for n, arrays in enumerate(inputs):
        assert_add_reply(by_id[b"b%d" % n], arrays)
        assert len(by_id[b"b%d" % n].timing) == wire.MAX_TIMING_KEYS


@pytest.mark.parametrize("code", ["BROKER_SHUTDOWN", "NO_SUCH_CODE", "BAD_CONFIG"])
def test_a_failure_code_a_worker_may_not_send_reaches_the_client_as_worker_failed(
    client: RawClient, worker: FakeWorker, code: str
) -> None:
    """BROKER_SHUTDOWN kept the client's request pending until its timeout; an unknown
    code reached it as a bare IpuserveError."""
    request_id = client.request("add", INPUTS)
    worker.fail(worker.job(), code, "made up")
    assert_error(client.recv(), request_id, "WORKER_FAILED")


def test_a_failure_code_a_worker_may_send_reaches_the_client_as_it_is(
    client: RawClient, worker: FakeWorker
) -> None:
    request_id = client.request("add", INPUTS)
    worker.fail(worker.job(), "INFERENCE_FAILED", "the model raised")
    assert_error(client.recv(), request_id, "INFERENCE_FAILED")


def test_a_result_frame_of_the_wrong_byte_count_is_the_workers_fault(
    client: RawClient, worker: FakeWorker
) -> None:
    """It reached the client as INVALID_INPUT, blaming its valid request."""
    request_id = client.request("add", INPUTS)
    frames = wire.Results((result_for(worker.job()),)).encode()
    frames[-1] = bytes(len(memoryview(frames[-1])) - 1)
    worker.socket.send_multipart(frames)
    assert_error(client.recv(), request_id, "WORKER_FAILED")


@pytest.mark.parametrize("rows", [1, 3])
def test_outputs_of_another_batch_size_than_the_request_are_not_forwarded(
    client: RawClient, worker: FakeWorker, rows: int
) -> None:
    request_id = client.request("add", INPUTS)  # 2 samples
    job = worker.job()
    z = np.zeros((rows, 8), dtype=np.float32)
    worker.send(wire.Results((wire.Result(job.job_id, wire.Tensors.of({"z": z}), {}),)))
    message = client.recv()
    assert_error(message, request_id, "WORKER_FAILED")
    assert isinstance(message, wire.ErrorReply) and "samples" in message.message
    # the right size still passes
    request_id = client.request("add", INPUTS)
    worker.answer(worker.job())
    reply = client.recv()
    assert isinstance(reply, wire.Reply) and reply.request_id == request_id
    assert_add_reply(reply, INPUTS)
