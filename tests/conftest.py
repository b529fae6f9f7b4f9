"""Fixtures shared by every test package.

Each test gets its own simulated-IPU "host" (a private lock directory and
inventory), so tests never contend with each other or with a developer's
running workers. Process fixtures live in tests/helpers.py; `npy_files` (the .npy inputs
the `infer` and `bench` commands read) and `served` (a broker with an `add` worker) are
here for tests/client and tests/bench alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import (
    BrokerProc,
    Processes,
    add_inputs,
    fn_worker_argv,
    processes,  # noqa: F401  (a fixture)
    start_broker,
    start_worker,
)


@pytest.fixture(autouse=True)
def isolated_ipu_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Give the test a private simulated-IPU inventory: 4 Mk2 IPUs, fast simulated time."""
    lock_dir = tmp_path_factory.mktemp("ipu-locks")
    saved = {k: os.environ.get(k) for k in _SIM_ENV}
    os.environ["IPUSERVE_SIM_LOCK_DIR"] = str(lock_dir)
    os.environ.setdefault("IPUSERVE_SIM_IPUS", "4")
    os.environ["IPUSERVE_SIM_TIME_SCALE"] = os.environ.get("IPUSERVE_TEST_TIME_SCALE", "0")
    try:
        yield lock_dir
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_SIM_ENV = ("IPUSERVE_SIM_LOCK_DIR", "IPUSERVE_SIM_IPUS", "IPUSERVE_SIM_TIME_SCALE")


@pytest.fixture
def npy_files(tmp_path: Path) -> dict[str, Path]:
    """x/y as the add model wants them, x as float64, an .npz and a text file: the inputs
    the ``infer`` and ``bench`` commands are given in the usability tests."""
    given = add_inputs(rows=4)
    files = {name: tmp_path / f"{name}.npy" for name in ("x", "y", "x64")}
    np.save(files["x"], given["x"])
    np.save(files["y"], given["y"])
    np.save(files["x64"], given["x"].astype(np.float64))
    files["npz"] = tmp_path / "x.npz"
    np.savez(files["npz"], x=given["x"])
    files["text"] = tmp_path / "x.txt"
    files["text"].write_text("1 2 3\n")
    return files


@pytest.fixture
def served(processes: Processes) -> BrokerProc:  # noqa: F811
    """A broker with one `add` worker (tests/fn_worker.py) registered."""
    broker = start_broker(processes)
    start_worker(processes, broker, fn_worker_argv("add"))
    return broker
