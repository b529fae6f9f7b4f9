"""The gRPC door against a hostile or careless client: bytes that are not a message,
messages far larger than what they declare, names without end, big calls with no token;
each with its status code, what it cost the gateway and that honest clients beside it
kept being served (:mod:`tests.gateway.abuse.watch`). The messages are written by hand
(:mod:`tests.gateway.abuse.payloads`), so nothing between the test and the door fixes
them."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.gateway.abuse import payloads as p
from tests.gateway.abuse.watch import GRPC_COPIES, HonestInfer, Watch
from tests.gateway.conftest import Fabric, GatewayProc, mlp_input, start_gateway, wait_ready

pytestmark = pytest.mark.slow

INFER = "/inference.GRPCInferenceService/ModelInfer"
DECLARED = 64 * 4
MESSAGE_LIMIT = 1000
#: room for the test's own messages (the door's limit is the gateway's default, 64 MiB)
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 * p.MIB)]


Metadata = tuple[tuple[str, str], ...]


def _call(address: str, message: bytes, metadata: Metadata = ()) -> grpc.RpcError:
    """Send ``message`` as a ModelInfer request's bytes; the error it is refused with."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        infer = channel.unary_unary(INFER)  # no serializers: the bytes go as they are
        with pytest.raises(grpc.RpcError) as refused:
            infer(message, metadata=metadata, timeout=120)
    return refused.value


def _check(error: grpc.RpcError, code: grpc.StatusCode, says: str) -> None:
    assert error.code() == code, (error.code(), error.details())
    details = error.details() or ""
    assert len(details) <= MESSAGE_LIMIT, details[:300]
    assert says in details.lower(), details


def test_garbage_bytes_are_invalid_argument(target: GatewayProc, watch: Watch) -> None:
    assert target.grpc is not None
    with watch.case("grpc-garbage", 0):
        error = _call(target.grpc, b"\xff\xfe\xfd garbage \x00\x01")
    _check(error, grpc.StatusCode.INVALID_ARGUMENT, "message")


def test_66_million_bool_contents_for_64_values(target: GatewayProc, watch: Watch) -> None:
    assert target.grpc is not None
    message = p.bool_contents_request(66_000_000)
    transport = GRPC_COPIES * len(message)  # it passed the (absent) token check
    with watch.case("grpc-bool-contents-66M", 64, transport):
        error = _call(target.grpc, message)
    _check(error, grpc.StatusCode.INVALID_ARGUMENT, "holds 64 elements")


def test_a_name_without_end_is_not_found_briefly(target: GatewayProc, watch: Watch) -> None:
    assert target.grpc is not None
    message = p.raw_input_request(DECLARED, model="m" * 100_000)
    with watch.case("grpc-model-name-100000", DECLARED):
        error = _call(target.grpc, message)
    _check(error, grpc.StatusCode.INVALID_ARGUMENT, "model name")


# ------------------------------------------------------------- with tokens configured


@pytest.fixture(scope="module")
def guarded(fabric: Fabric, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    folder: Path = tmp_path_factory.mktemp("abuse-tokens")
    (folder / "infer").write_text("honest-infer-token\n")
    gateway = start_gateway(
        fabric.procs, fabric.broker, "--infer-tokens", str(folder / "infer"),
        name="guarded-gateway",
    )  # fmt: skip
    wait_ready(gateway)
    yield gateway
    assert "Traceback" not in gateway.proc.output()


def test_big_calls_without_a_token_cost_nothing(fabric: Fabric, guarded: GatewayProc) -> None:
    """Eight 60 MiB calls at once with no token: refused before they are parsed."""
    assert guarded.grpc is not None
    host, port = guarded.host_port.rsplit(":", 1)
    x = mlp_input(1, seed=6)
    want = fabric.models["mlp"].reference({"input": x})["logits"]
    honest = HonestInfer(host, int(port), x, want, token="honest-infer-token")
    watch = Watch(guarded.proc.pid, host, int(port), honest)
    message = p.raw_input_request(60 * p.MIB)
    with watch.case("grpc-60MiB-x8-no-token", 0), ThreadPoolExecutor(8) as pool:
        errors = list(pool.map(lambda _: _call(guarded.grpc or "", message), range(8)))
    for error in errors:
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (error.code(), error.details())
