"""Mistakes a user makes on the command line or with the Client get one clear line each.

Endpoints without a transport, unreadable input files, an --output path, inputs that
are not a dict of arrays, and a client pointed where nothing (or a broker's backend)
answers. The bench's own mistakes: tests/bench/test_usability.py.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from ipuserve.bench.processes import free_port
from ipuserve.client import AsyncClient, Client, ClientConfig, link
from ipuserve.endpoints import endpoint_problem
from ipuserve.errors import ConfigError, DeadlineExceeded, InvalidInputError, UnavailableError
from ipuserve.face.cli import main
from tests.helpers import (
    BrokerProc,
    Processes,
    add_inputs,
    processes,  # noqa: F401  (a fixture)
    start_broker,
)

NOWHERE = "tcp://127.0.0.1:1"  # never dialled: every test using it fails before sending


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def last_line(result: Result) -> str:
    return result.output.strip().splitlines()[-1]


# ------------------------------------------------------------------ 1. endpoints

ADVICE = "use tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555)"


@pytest.mark.parametrize(
    "args",
    [
        ["infer", "--broker", "127.0.0.1:25555", "--model", "m", "--input", "x=x.npy"],
        ["models", "--broker", "127.0.0.1:25555"],
        ["bench", "--broker", "127.0.0.1:25555", "--model", "m"],
        ["worker", "--broker", "127.0.0.1:25555", "--model", "m.popef"],
        ["broker", "--frontend", "127.0.0.1:25555"],
        ["broker", "--backend", "127.0.0.1:25555"],
    ],
    ids=["infer", "models", "bench", "worker", "broker-frontend", "broker-backend"],
)
def test_an_endpoint_without_a_transport_is_a_usage_error(args: list[str]) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert "'127.0.0.1:25555' is not a ZeroMQ endpoint; use tcp://HOST:PORT (e.g. tcp://" in (
        last_line(result)
    )
    assert "Traceback" not in result.output


def test_endpoint_check_accepts_the_transports_and_binds_only_where_binding() -> None:
    for good in ("tcp://127.0.0.1:5555", "tcp://broker:5555", "ipc:///tmp/b.ipc", "inproc://b"):
        assert endpoint_problem(good) is None
    for bind in ("tcp://*:5555", "tcp://127.0.0.1:*"):
        assert endpoint_problem(bind, bind=True) is None
        assert endpoint_problem(bind) == f"{bind!r} is a bind address ('*'); to connect, {ADVICE}"
    assert endpoint_problem("tcp://127.0.0.1") == (
        f"'tcp://127.0.0.1' is not a ZeroMQ endpoint (no port); {ADVICE}"
    )
    assert endpoint_problem("127.0.0.1:25555") == (
        f"'127.0.0.1:25555' is not a ZeroMQ endpoint; {ADVICE}"
    )
    assert endpoint_problem("http://b:80") is not None
    assert endpoint_problem("tcp://b:70000") is not None


@pytest.mark.parametrize("address", ["127.0.0.1:25555", "tcp://*:5555", "tcp://b:x"])
def test_a_client_refuses_a_malformed_address_with_config_error(address: str) -> None:
    with pytest.raises(ConfigError) as refused:
        Client(address)
    assert str(refused.value).startswith(repr(address))
    assert str(refused.value).endswith(ADVICE)


# ------------------------------------------------------------------ 2. infer --output


@pytest.mark.slow
def test_infer_writes_its_output_to_exactly_the_path_given(
    served: BrokerProc, npy_files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    inputs = ["--input", f"x={npy_files['x']}", "--input", f"y={npy_files['y']}"]
    infer = ["infer", "--broker", served.frontend, "--model", "add", *inputs]
    result = run(*infer, "--output", str(out))
    assert result.exit_code == 0, result.output
    assert f"saved z to {out}" in result.output
    assert not Path(f"{out}.npz").exists()
    with np.load(out) as saved:
        assert saved["z"].shape == (4, 8)

    bad = tmp_path / "missing" / "y.npz"
    result = run(*infer, "--output", str(bad))
    assert result.exit_code == 1
    assert result.output.splitlines() == [  # refused before the request, nothing printed
        f"Error: cannot write {bad}: {bad.parent} is not a directory"
    ]


# ------------------------------------------------------------------ 3. input files


@pytest.mark.parametrize("command", ["infer", "bench"])
@pytest.mark.parametrize(
    ("kind", "why"),
    [
        (
            "npz",
            "a zip archive (an .npz?), not a single array; save the tensor alone with numpy.save",
        ),
        ("text", "not a .npy file (no NUMPY header)"),
    ],
)
def test_an_input_file_that_is_not_one_npy_array_is_named_on_one_line(
    npy_files: dict[str, Path], command: str, kind: str, why: str
) -> None:
    path = npy_files[kind]
    result = run(command, "--broker", NOWHERE, "--model", "add", "--input", f"x={path}")
    assert result.exit_code == 2, result.output
    assert last_line(result) == (
        f"Error: Invalid value for '--input': input 'x': cannot read {path}: {why}"
    )


# ------------------------------------------------------------------ 4. an input given twice


def test_infer_refuses_an_input_given_twice(npy_files: dict[str, Path]) -> None:
    x, text = npy_files["x"], npy_files["text"]
    args = ["--input", f"x={x}", "--input", f"x={text}"]
    result = run("infer", "--broker", NOWHERE, "--model", "add", *args)
    assert result.exit_code == 2
    assert last_line(result).endswith(f"input 'x' is given twice: {x} and {text}")


# ------------------------------------------------------------------ 5. Client inputs


def test_client_infer_refuses_an_array_instead_of_a_dict() -> None:
    with Client(NOWHERE) as client:
        with pytest.raises(
            InvalidInputError,
            match=r"^inputs must be a dict of input name -> numpy array, not a numpy\.ndarray$",
        ):
            client.infer_async("add", np.zeros((2, 8), np.float32))  # type: ignore[arg-type]
        with pytest.raises(
            InvalidInputError, match=r"^input 'y' is a list, not a numpy array; convert it"
        ):
            client.infer_async("add", {"x": np.zeros((2, 8), np.float32), "y": [[1.0] * 8] * 2})
        assert client.stats.sent == 0


def test_a_misspelled_option_is_refused_by_every_call_that_sends_a_request() -> None:
    """The options are declared once (``**options: Unpack[RequestOptions]``); a keyword
    none of them names raises ``TypeError`` at once, as an explicit signature did, and
    the ones they name still take effect (a bad timeout is checked)."""
    given = add_inputs(2)
    with Client(NOWHERE) as client:
        with pytest.raises(TypeError, match=r"^unexpected keyword argument\(s\): timout$"):
            client.infer_async("add", given, timout=1.0)  # type: ignore[call-arg]
        with pytest.raises(ConfigError, match="timeout must be seconds > 0"):
            client.infer_async("add", given, timeout=-1.0, copy=False)
        assert client.stats.sent == 0

    async def faces() -> None:
        async with AsyncClient(NOWHERE) as client:
            with pytest.raises(TypeError, match=r"^unexpected keyword argument\(s\): cpy$"):
                await client.infer("add", given, cpy=False)  # type: ignore[call-arg]
            with pytest.raises(TypeError, match=r"^unexpected keyword argument\(s\): a, b$"):
                await client.infer_timed("add", given, b=1, a=2)  # type: ignore[call-arg]
            with pytest.raises(ConfigError, match="timeout must be seconds > 0"):
                await client.infer_timed("add", given, timeout=0.0)
            assert client.stats.sent == 0

    asyncio.run(faces())


# ------------------------------------------------------------------ 6. nobody answers

HINT = "since the client started; is the broker running, and is this its frontend (client) port?"


def test_a_timeout_with_nothing_listening_says_nothing_ever_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    config = ClientConfig(ping_interval_s=0.05, liveness_s=0.1)
    with (
        caplog.at_level(logging.WARNING),
        Client(address, config=config) as client,
        pytest.raises(DeadlineExceeded) as failed,
    ):
        client.infer("add", add_inputs(), timeout=1.0)
    assert str(failed.value).endswith(f": nothing has answered at {address} {HINT}")
    silent = [r.getMessage() for r in caplog.records if "broker silent" in r.getMessage()]
    assert silent, "no warning about the silence"
    assert silent[0].endswith(  # nothing to re-send over: it goes when connected
        f", not connected; 1 pending go again once it is: nothing has answered at {address} {HINT}"
    )
    assert not any("nothing has answered" in line for line in silent[1:])


def test_infer_with_nothing_listening_suggests_checking_the_endpoint(
    npy_files: dict[str, Path],
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    inputs = ["--input", f"x={npy_files['x']}", "--input", f"y={npy_files['y']}"]
    result = run("infer", "--broker", address, "--model", "add", *inputs, "--timeout-s", "0.5")
    assert result.exit_code == 1
    line = last_line(result)
    assert line.startswith("Error: [DEADLINE_EXCEEDED] no reply within 0.5 s (request ")
    assert line.endswith(f"): nothing has answered at {address} {HINT}")


def test_a_timeout_too_short_to_hear_anything_does_not_blame_the_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the threshold widened: a loaded machine may take 50 ms to expire a 1 ms timeout
    monkeypatch.setattr(link, "SUSPECT_SILENCE_S", 10.0)
    address = f"tcp://127.0.0.1:{free_port()}"
    with Client(address) as client, pytest.raises(DeadlineExceeded) as failed:
        client.infer("add", add_inputs(), timeout=0.001)
    assert "nothing has answered" not in str(failed.value)


@pytest.mark.slow
def test_a_timeout_from_a_live_broker_does_not_blame_the_endpoint(
    processes: Processes,  # noqa: F811
) -> None:
    broker = start_broker(processes, grace_ms=60_000)  # queues for a model nobody serves
    with Client(broker.frontend) as client, pytest.raises(DeadlineExceeded) as failed:
        client.infer("nobody", add_inputs(), timeout=0.3)
    assert "nothing has answered" not in str(failed.value)


@pytest.mark.slow
def test_a_client_pointed_at_the_backend_port_is_told_so_at_once(
    processes: Processes,  # noqa: F811
) -> None:
    broker = start_broker(processes)
    with Client(broker.backend) as client, pytest.raises(UnavailableError) as failed:
        client.infer("add", add_inputs(), timeout=60.0)
    assert str(failed.value) == (
        f"{broker.backend} answers as a broker's backend (worker) port; "
        "clients connect to its frontend (client) port"
    )
