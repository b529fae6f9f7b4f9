"""The request schema is checked once, by the broker, where a request enters the fabric.

The worker trusts what the broker forwards (its runner runs with ``validate_io_params``
off) and no longer checks a job's tensors again. These tests show that each check the
worker and the runtime used to repeat still reaches the client -- with the same code and
message -- from the one owner left: a real broker, a real `ipuserve worker` with a
ModelRunner, the real Client (and a bare DEALER for a frame no Client would send)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ipuserve import protocol as wire
from ipuserve.client import Client
from ipuserve.errors import InvalidInputError
from ipuserve.runtime.popef import examples, load_model
from tests.helpers import (
    BrokerProc,
    Processes,
    RawClient,
    runner_worker_argv,
    start_broker,
    start_worker,
    write_example,
)

pytestmark = pytest.mark.slow

SAMPLE = (4,)  # the `simple` example's tensor_A / tensor_B: float32 [batch, 4]


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProc, str]]:
    procs = Processes()
    try:
        path = write_example(
            tmp_path_factory.mktemp("models") / "simple.popef", "simple", "--batch-size", "4"
        )
        broker = start_broker(procs)
        start_worker(procs, broker, runner_worker_argv(path))
        yield broker, path
    finally:
        procs.close()


def good(rows: int = 2) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(rows)
    names = ("tensor_A", "tensor_B")
    return {n: rng.standard_normal((rows, *SAMPLE)).astype(np.float32) for n in names}


def refused(broker: BrokerProc, inputs: dict[str, Any]) -> InvalidInputError:
    with Client(broker.frontend, timeout=30) as client, pytest.raises(InvalidInputError) as info:
        client.infer("simple", inputs)
    return info.value


def test_an_unknown_tensor_is_refused_with_invalid_input(fabric: tuple[BrokerProc, str]) -> None:
    broker, _path = fabric
    inputs = good()
    inputs["tensor_C"] = inputs.pop("tensor_B")
    error = refused(broker, inputs)
    assert error.code == "INVALID_INPUT"
    assert str(error) == (
        "model 'simple' has no input 'tensor_C'; its inputs are tensor_A, tensor_B "
        "(missing: tensor_B)"
    )


def test_a_wrong_dtype_is_refused_with_invalid_input(fabric: tuple[BrokerProc, str]) -> None:
    broker, _path = fabric
    inputs = good()
    inputs["tensor_B"] = inputs["tensor_B"].astype(np.float64)
    error = refused(broker, inputs)
    assert error.code == "INVALID_INPUT"
    assert str(error) == (
        "input 'tensor_B' of model 'simple' must be float32, got float64 "
        "(convert it: x.astype(np.float32))"
    )


def test_a_wrong_shape_is_refused_with_invalid_input(fabric: tuple[BrokerProc, str]) -> None:
    broker, _path = fabric
    inputs = good()
    inputs["tensor_A"] = np.zeros((2, 5), np.float32)
    error = refused(broker, inputs)
    assert error.code == "INVALID_INPUT"
    assert str(error) == (
        "input 'tensor_A' of model 'simple' must have shape (4, 4) "
        "(dimension 0 may be any size >= 1), got (2, 5)"
    )


def test_a_wrong_byte_count_is_refused_with_invalid_input(
    fabric: tuple[BrokerProc, str],
) -> None:
    broker, _path = fabric
    frames = wire.Request(b"short", "simple", wire.Tensors.of(good()), None).encode()
    with RawClient(broker.frontend) as raw:
        raw.send_frames([*frames[:-1], b"\x00" * 12])  # tensor_B: 12 bytes, not 32
        reply = raw.recv()
    assert isinstance(reply, wire.ErrorReply) and reply.request_id == b"short"
    assert reply.code == "INVALID_INPUT"
    assert reply.message == "tensor 'tensor_B' (float32[2, 4]) needs 32 bytes; its frame has 12"


def test_a_good_request_after_the_refusals_gets_the_numpy_result(
    fabric: tuple[BrokerProc, str],
) -> None:
    broker, path = fabric
    inputs = good(3)
    weights = examples.tensor_arrays(load_model([path]))
    with Client(broker.frontend, timeout=30) as client:
        got = client.infer("simple", inputs)
    want = examples.reference("simple", inputs, weights)["output"]
    np.testing.assert_allclose(got["output"], want, rtol=1e-5, atol=1e-6)
