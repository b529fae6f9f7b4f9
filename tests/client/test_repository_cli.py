"""``ipuserve models load | unload | index`` (and ``models``, ``infer --version``) as a
user runs them: real ``ipuserve`` processes against a real broker and repository worker.

The fabric is test_repository.py's (a broker and ``host1``, a repository worker with 4
simulated IPUs, over a CLI-written repository with ``mlp`` versions 1 and 2 that numpy
tells apart); each test starts with nothing loaded and what it loaded is unloaded after
it. What a command sent is read from the broker's metrics; after a load, a request
through ``Client`` is checked against the numpy reference of the version loaded. The
progress line is read from a pseudo-terminal, where the command draws it (it draws none
into a pipe). PERMISSION_DENIED comes from a CURVE broker whose admin allow-list the
command's key is not in. Nothing here needs a scripted broker.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipuserve.client import Client
from tests.client.test_repository import HOST, TIMEOUT_S, Fabric, counted, mlp_inputs
from tests.helpers import Processes, wait_until
from tests.integration.test_curve import admin_only_broker

#: one command's limit: a Python start on a busy two-core machine, and its wait
RUN_TIMEOUT_S = 120.0
#: the progress line of ``models load mlp`` while it waits for version 2
DRAWING = r"loading mlp +\d+\.\d s +[01] ready  v1 UNAVAILABLE v2 (UNAVAILABLE|LOADING|READY)"
EMPTY = "(nothing: no repository worker has joined, or none holds it)"


@dataclass
class Ran:
    """An ``ipuserve`` process that ended: its exit code and what it printed."""

    code: int
    out: str
    err: str

    @property
    def rows(self) -> list[list[str]]:
        """The table's rows below its header and rule, split on blanks."""
        return [line.split() for line in self.out.splitlines()[2:]]


def _env() -> dict[str, str]:
    """This environment without the ``models`` commands' own variables, so that only
    the options given count (a ``IPUSERVE_MODELS_BROKER`` here would hide a missing
    ``--broker``)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("IPUSERVE_MODELS_")}


def ipuserve(*args: str) -> Ran:
    """``ipuserve ARGS...`` with its output in pipes (no terminal: no progress line)."""
    done = subprocess.run(
        [sys.executable, "-m", "ipuserve", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=_env(),
        timeout=RUN_TIMEOUT_S,
    )
    return Ran(done.returncode, done.stdout, done.stderr)


def ipuserve_on_a_terminal(*args: str) -> Ran:
    """``ipuserve ARGS...`` with stderr on a pseudo-terminal (stdout in a pipe), as a
    user's shell that redirects only the table; ``err`` is all the terminal got."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ipuserve", *args],
            stdout=subprocess.PIPE,
            stderr=follower,
            stdin=subprocess.DEVNULL,
            env=_env(),
        )
    finally:
        os.close(follower)  # the child holds its own: EOF (EIO) once it exits
    chunks: list[bytes] = []

    def drain() -> None:  # read as it comes, so a full terminal buffer never blocks it
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the child's end closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, name="read-pty", daemon=True)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        reader.join(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return Ran(proc.returncode, out.decode(), b"".join(chunks).decode())


def polls(fabric: Fabric) -> float:
    """The index questions the broker answered: a waiting command asks them."""
    return fabric.counts("repository_commands_total", action="index")


def loads(fabric: Fabric) -> float:
    return fabric.counts("repository_commands_total", action="load")


def assert_answers_as(fabric: Fabric, version: str, *, named: str | None) -> None:
    """A request through ``Client`` (naming ``named``) is answered by ``version``, with
    the numpy reference of ``version``'s weights."""
    with Client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        given = mlp_inputs(int(version))
        outputs = client.infer("mlp", given, version=named)
    assert outputs.version == version
    assert fabric.versions.which(given, outputs) == version


def state_of(client: Client, version: str) -> tuple[str, int]:
    """``mlp`` ``version``'s state and worker count in the broker's index now."""
    found = client.repository_index().find("mlp", version)
    assert found is not None
    return found.state, len(found.workers)


# ---------------------------------------------------------------- load


def test_load_waits_until_ready_and_shows_the_models_versions(fabric: Fabric) -> None:
    before_loads, before_polls = loads(fabric), polls(fabric)
    ran = ipuserve("models", "load", "mlp", "--version", "2", "--broker", fabric.broker.frontend)
    assert ran.code == 0, ran.err
    assert ran.rows == [
        ["mlp", "1", "UNAVAILABLE", "0", "not", "loaded"],
        ["mlp", "2", "*", "READY", "1", f"{HOST}/mlp/2"],
    ]
    assert ran.err == f"loading model 'mlp' version 2 on {HOST} (1 replica(s))\n"
    assert "\r" not in ran.err  # no progress line into a pipe
    assert loads(fabric) == before_loads + 1
    assert polls(fabric) > before_polls  # it asked the index until READY
    assert_answers_as(fabric, "2", named="2")


def test_load_without_a_version_loads_the_latest_and_draws_its_progress_on_a_terminal(
    fabric: Fabric,
) -> None:
    ran = ipuserve_on_a_terminal("models", "load", "mlp", "--broker", fabric.broker.frontend)
    assert ran.code == 0, ran.err
    assert ran.rows[-1] == ["mlp", "2", "*", "READY", "1", f"{HOST}/mlp/2"]
    # one line drawn over itself (\r), the wait's states, then ended for what follows
    drawn, message = ran.err.replace("\r\n", "\n").lstrip("\r").split("\n", 1)
    # drawn at most every 0.2 s, but the line ends on the state the wait ended on
    drawings = drawn.split("\r")
    for drawing in drawings:
        assert re.fullmatch(DRAWING, drawing), drawing
    assert drawings[-1].endswith("1 ready  v1 UNAVAILABLE v2 READY"), drawings[-1]
    assert message == f"loading model 'mlp' version 2 on {HOST} (1 replica(s))\n"
    assert_answers_as(fabric, "2", named=None)


def test_load_no_wait_returns_the_brokers_answer_as_json_at_once(fabric: Fabric) -> None:
    before_polls = polls(fabric)
    args = ["--replicas", "2", "--workers", "1", "--no-wait", "--json"]
    ran = ipuserve("models", "load", "mlp", *args, "--broker", fabric.broker.frontend)
    assert ran.code == 0, ran.err
    found = json.loads(ran.out)
    assert found["message"] == f"loading model 'mlp' version 2 on {HOST} (2 replica(s))"
    assert [m["version"] for m in found["models"]] == ["1", "2"]
    assert polls(fabric) == before_polls  # returned without waiting
    with Client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        wait_until(lambda: state_of(client, "2") == ("READY", 1), timeout=TIMEOUT_S)
    assert_answers_as(fabric, "2", named=None)
    # its 2 replicas hold 2 of the host's 4 IPUs
    ran = ipuserve("models", "load", "mlp", "--version", "1", "--replicas", "3",
                   "--broker", fabric.broker.frontend)  # fmt: skip
    assert ran.code == 1 and ran.out == ""
    assert ran.err.startswith("Error: [NO_ROOM] ")
    assert f"{HOST}: 2 of 4 IPU(s) free, 3 needed" in ran.err


# ---------------------------------------------------------------- unload and index


def test_unload_waits_until_gone_and_index_shows_the_states_with_their_reasons(
    fabric: Fabric,
) -> None:
    with Client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        client.load_model("mlp", 1, timeout=TIMEOUT_S)
        client.load_model("mlp", 2, timeout=TIMEOUT_S)
    broker = ("--broker", fabric.broker.frontend)
    ran = ipuserve("models", "index", *broker)
    assert ran.code == 0, ran.err
    assert ran.out.splitlines()[:2] == [
        "model                 version   state        workers  reason",
        "-" * 60,
    ]
    assert ran.out.splitlines()[2:] == [
        f"mlp                         1   READY              1  {HOST}/mlp/1",
        f"mlp                         2 * READY              1  {HOST}/mlp/2",
    ]

    before_polls = polls(fabric)
    ran = ipuserve("models", "unload", "mlp", "--version", "1", *broker)
    assert ran.code == 0, ran.err
    assert ran.err == f"unloading model 'mlp' version 1 on {HOST}\n"
    assert ran.rows[0] == ["mlp", "1", "UNAVAILABLE", "0", "not", "loaded"]
    assert polls(fabric) > before_polls  # it waited until gone
    assert_answers_as(fabric, "2", named=None)  # the other version still answers

    ran = ipuserve("models", "index", "--json", *broker)
    assert ran.code == 0, ran.err
    listed = {m["version"]: (m["state"], m.get("reason")) for m in json.loads(ran.out)["models"]}
    assert listed == {"1": ("UNAVAILABLE", "not loaded"), "2": ("READY", None)}  # none: no key

    ran = ipuserve("models", "unload", "mlp", *broker)  # every loaded version
    assert ran.code == 0, ran.err
    assert [row[2] for row in ran.rows] == ["UNAVAILABLE", "UNAVAILABLE"]
    with Client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        assert state_of(client, "2") == ("UNAVAILABLE", 0)


def test_models_alone_still_lists_the_brokers_models_and_needs_a_broker(
    fabric: Fabric,
) -> None:
    with Client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        client.load_model("mlp", 1, timeout=TIMEOUT_S)
    ran = ipuserve("models", "--broker", fabric.broker.frontend)
    assert ran.code == 0, ran.err
    rows = [line.split() for line in ran.out.splitlines()[2:] if not line.startswith(" ")]
    # (a version a test before unloaded stays listed, its worker gone or going)
    assert ["mlp", "1", "16", "0", f"{HOST}/mlp/1"] in [row[:5] for row in rows]
    ran = ipuserve("models")
    assert ran.code == 2 and "Missing option '--broker'" in ran.err


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "args, code, reason",
    [
        (["nope"], "UNKNOWN_MODEL", "no worker's repository holds model"),
        (["mlp", "--version", "3"], "UNKNOWN_MODEL", "holds version 3 of model 'mlp'"),
        (["mlp", "--replicas", "5"], "NO_ROOM", f"{HOST}: 4 of 4 IPU(s) free, 5 needed"),
    ],
)
def test_a_refused_load_is_a_one_line_error_with_its_code_and_waits_for_nothing(
    fabric: Fabric,
    args: list[str],
    code: str,
    reason: str,
) -> None:
    refused = fabric.counts("repository_refused_total", reason=code)
    before_polls = polls(fabric)
    ran = ipuserve("models", "load", *args, "--broker", fabric.broker.frontend)
    assert ran.code == 1 and ran.out == ""
    assert len(ran.err.splitlines()) == 1 and ran.err.startswith(f"Error: [{code}] ")
    assert reason in ran.err
    assert fabric.counts("repository_refused_total", reason=code) == refused + 1
    assert polls(fabric) == before_polls


def test_a_client_key_is_refused_permission_denied_and_an_admin_key_answered(
    processes: Processes, tmp_path: Path
) -> None:
    """A CURVE broker answers the repository's commands to admin keys only (its admin
    allow-list, from the environment as a deployment gives it)."""
    keys, broker = admin_only_broker(processes, tmp_path, "client")
    where = ("--broker", broker.frontend)

    ran = ipuserve("models", "load", "mlp", *where, *keys.peer_options("client"))
    assert ran.code == 1 and ran.out == ""
    assert ran.err.startswith("Error: [PERMISSION_DENIED] ") and len(ran.err.splitlines()) == 1
    assert "needs the admin role" in ran.err
    assert counted(broker, "repository_refused_total", reason="PERMISSION_DENIED") == 1
    assert counted(broker, "repository_commands_total") == 0

    ran = ipuserve("models", "index", *where, *keys.peer_options("admin"))
    assert ran.code == 0, ran.err
    assert ran.out.splitlines()[2:] == [EMPTY]  # answered: no repository worker yet
    assert counted(broker, "repository_commands_total", action="index") == 1


# ---------------------------------------------------------------- infer --version


def test_infer_asks_for_a_version_and_says_which_answered(
    fabric: Fabric,
    tmp_path: Path,
) -> None:
    with Client(fabric.broker.frontend, timeout=TIMEOUT_S) as client:
        client.load_model("mlp", 1, timeout=TIMEOUT_S)
        client.load_model("mlp", 2, timeout=TIMEOUT_S)
    given = mlp_inputs(7)
    np.save(tmp_path / "input.npy", given["input"])
    for named, answers in (("1", "1"), (None, "2")):  # default: the latest
        saved = tmp_path / f"out-{named}.npz"
        args = ["infer", "--broker", fabric.broker.frontend, "--model", "mlp"]
        args += ["--input", f"input={tmp_path / 'input.npy'}", "--output", str(saved)]
        ran = ipuserve(*args, *(["--version", named] if named else []))
        assert ran.code == 0, ran.err
        want = fabric.versions.reference(answers, given)
        assert [line.split(" min ")[0] for line in ran.out.splitlines()] == [
            f"{name}: {array.dtype}{list(array.shape)}" for name, array in want.items()
        ]
        assert f"ms (version {answers})\n" in ran.err
        with np.load(saved) as got:
            outputs: dict[str, Any] = {name: got[name] for name in got.files}
        assert fabric.versions.which(given, outputs) == answers
