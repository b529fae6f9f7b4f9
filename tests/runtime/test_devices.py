"""DeviceManager on the simulated host: IDs, sizes, locks across processes, wait strategies."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ipuserve.errors import ConfigError, DeviceRequestError, DeviceUnavailableError
from ipuserve.runtime.devices import (
    Device,
    DeviceConstraints,
    DeviceManager,
    DeviceWaitConfig,
    DeviceWaitStrategy,
)
from ipuserve.runtime.popef import GraphBuilder
from ipuserve.runtime.popef.types import Model
from ipuserve.runtime.simulator.config import SimulatorConfig, parse_blas_threads, parse_ipus
from ipuserve.runtime.simulator.inventory import device_slots, holders

NO_WAIT = DeviceWaitConfig(DeviceWaitStrategy.NO_WAIT)


def manager(lock_dir: Path, ipus: int = 4, version: int = 2) -> DeviceManager:
    return DeviceManager(SimulatorConfig(num_ipus=ipus, ipu_version=version, lock_dir=lock_dir))


def test_device_ids_follow_poplar_numbering() -> None:
    slots = device_slots(4)
    assert [(s.device_id, s.ipus) for s in slots] == [
        (0, (0,)),
        (1, (1,)),
        (2, (2,)),
        (3, (3,)),
        (4, (0, 1)),
        (5, (2, 3)),
        (6, (0, 1, 2, 3)),
    ]
    assert [s.num_ipus for s in device_slots(16)].count(16) == 1
    assert len(device_slots(16)) == 16 + 8 + 4 + 2 + 1


def test_environment_describes_the_host() -> None:
    assert parse_ipus("8:21") == (8, 21)
    config = SimulatorConfig.from_env({"IPUSERVE_SIM_IPUS": "2", "IPUSERVE_SIM_TIME_SCALE": "0.5"})
    assert (config.num_ipus, config.ipu_version, config.time_scale) == (2, 2, 0.5)
    for bad in ("four", "4:7", "-1"):
        with pytest.raises(ConfigError, match="IPUSERVE_SIM_IPUS"):
            parse_ipus(bad)
    with pytest.raises(ConfigError, match="IPUSERVE_SIM_TIME_SCALE"):
        SimulatorConfig.from_env({"IPUSERVE_SIM_TIME_SCALE": "fast"})
    # empty means unset (compose.yaml passes variables the user did not set empty)
    empty = SimulatorConfig.from_env({"IPUSERVE_SIM_IPUS": "", "IPUSERVE_SIM_TIME_SCALE": ""})
    assert (empty.num_ipus, empty.time_scale) == (4, 1.0)


def test_blas_threads_come_from_the_environment_or_say_what_is_wrong() -> None:
    assert parse_blas_threads("3") == 3
    for bad in ("two", "0", "-1", "1.5"):
        with pytest.raises(ConfigError, match=f"IPUSERVE_SIM_BLAS_THREADS={bad!r}: expected a"):
            parse_blas_threads(bad)


def test_hardware_version(isolated_ipu_host: Path) -> None:
    assert manager(isolated_ipu_host).ipuHardwareVersion() == 2
    assert manager(isolated_ipu_host, version=21).ipuHardwareVersion() == 21
    assert manager(isolated_ipu_host, ipus=0).ipuHardwareVersion() == 0


def test_devices_are_exclusive_within_a_process(isolated_ipu_host: Path) -> None:
    dm = manager(isolated_ipu_host)
    held = [dm.getDevice(1, wait_config=NO_WAIT) for _ in range(4)]
    assert sorted(d.getId() for d in held) == [0, 1, 2, 3]
    assert dm.tryGetDevice(1, wait_config=NO_WAIT) is None
    with pytest.raises(DeviceUnavailableError, match=r"no free device with 1 IPU"):
        dm.getDevice(1, wait_config=NO_WAIT)
    with pytest.raises(DeviceUnavailableError):
        dm.getSpecificDevice(4, wait_config=NO_WAIT)  # the pair {0,1} overlaps held IPUs
    held[0].detach()
    again = dm.getDevice(1, wait_config=NO_WAIT)
    assert again.getId() == 0
    for device in [again, *held[1:]]:
        device.detach()
    assert dm.getSpecificDevice(6, wait_config=NO_WAIT).ipus() == (0, 1, 2, 3)


@pytest.mark.parametrize("strategy", list(DeviceWaitStrategy))
def test_impossible_requests_fail_at_once_whatever_the_strategy(
    isolated_ipu_host: Path, strategy: DeviceWaitStrategy
) -> None:
    dm = manager(isolated_ipu_host)
    wait = DeviceWaitConfig(strategy, timeout=timedelta(hours=1), sleepTime=timedelta(seconds=1))
    with pytest.raises(DeviceRequestError, match=r"3 IPU\(s\) can never be attached.*1, 2, 4"):
        dm.getDevice(3, wait_config=wait)
    with pytest.raises(DeviceRequestError, match="8 IPU"):
        dm.getDevice(8, wait_config=wait)
    with pytest.raises(DeviceRequestError, match="no device 7"):
        dm.getSpecificDevice(7, wait_config=wait)
    # the try* variants return None, as the spec says ("otherwise a nullptr"), at once
    assert dm.tryGetDevice(3, wait_config=wait) is None
    assert dm.tryGetDevice(8, wait_config=wait) is None
    assert dm.tryGetSpecificDevice(7, wait_config=wait) is None


def compiled_for(num_ipus: int, ipu_version: int) -> Model:
    """A tiny identity model compiled for ``num_ipus`` IPUs of ``ipu_version``."""
    g = GraphBuilder("tiny", batch_size=1, num_ipus=num_ipus, ipu_version=ipu_version)
    g.output("y", g.identity(g.input("x", (1, 2))))
    return g.build()


def test_requests_by_model_take_its_ipu_count(isolated_ipu_host: Path) -> None:
    dm = manager(isolated_ipu_host)
    pair_model = compiled_for(2, 2)
    first = dm.getDevice(pair_model, wait_config=NO_WAIT)
    second = dm.tryGetDevice(pair_model, wait_config=NO_WAIT)
    assert second is not None
    assert [(d.getId(), d.ipus()) for d in (first, second)] == [(4, (0, 1)), (5, (2, 3))]
    assert dm.tryGetDevice(pair_model, wait_config=NO_WAIT) is None
    for device in (first, second):
        device.detach()
    specific = dm.getSpecificDevice(0, compiled_for(1, 2), NO_WAIT)
    assert specific.ipus() == (0,)
    specific.detach()


@pytest.mark.parametrize("strategy", list(DeviceWaitStrategy))
def test_requests_by_model_refuse_what_the_host_cannot_run(
    isolated_ipu_host: Path, strategy: DeviceWaitStrategy
) -> None:
    dm = manager(isolated_ipu_host)
    wait = DeviceWaitConfig(strategy, timeout=timedelta(hours=1), sleepTime=timedelta(seconds=1))
    c600_model = compiled_for(1, 21)
    version = r"'tiny' was compiled for IPU version 21 but this host has 4 Mk2 \(GC200\)"
    requests: list[Callable[[], Device | None]] = [
        lambda: dm.getDevice(c600_model, wait_config=wait),
        lambda: dm.getSpecificDevice(0, c600_model, wait),
    ]
    for request in requests:
        with pytest.raises(DeviceRequestError, match=version):
            request()
    assert dm.tryGetDevice(c600_model, wait_config=wait) is None
    assert dm.tryGetSpecificDevice(0, c600_model, wait) is None
    mismatch = r"device 4 has 2 IPU\(s\) but model 'tiny' needs 1"
    with pytest.raises(DeviceRequestError, match=mismatch):
        dm.getSpecificDevice(4, compiled_for(1, 2), wait)
    assert dm.tryGetSpecificDevice(4, compiled_for(1, 2), wait) is None
    with pytest.raises(DeviceRequestError, match=r"3 IPU\(s\) can never be attached"):
        dm.getDevice(compiled_for(3, 2), wait_config=wait)
    assert not list(holders(isolated_ipu_host, 4))  # nothing was attached on the way


def test_remote_buffer_constraint(isolated_ipu_host: Path) -> None:
    with pytest.raises(DeviceRequestError, match="remote buffers"):
        manager(isolated_ipu_host, version=1).getDevice(
            1, constrains=DeviceConstraints(requiresRemoteBuffersSupport=True)
        )
    device = manager(isolated_ipu_host).getDevice(1, constrains=DeviceConstraints(True))
    device.detach()


def test_ipu_model_devices_need_no_lock(isolated_ipu_host: Path) -> None:
    dm = manager(isolated_ipu_host)
    everything = dm.getSpecificDevice(6)
    model = dm.createIpuModelDevice(2, tiles_per_ipu=100)
    small = dm.createSmallIpuModelDevice(1)
    assert model.isIpuModel() and model.numIpus() == 2 and model.tilesPerIpu() == 100
    assert small.memoryBytes() == 4 * 624 * 1024
    for device in (everything, model, small):
        device.detach()


# -- two processes ----------------------------------------------------------------

_HOLDER = textwrap.dedent("""
    import sys
    from ipuserve.runtime.devices import DeviceManager
    device = DeviceManager().getSpecificDevice(int(sys.argv[1]))
    print("held", device.getId(), flush=True)
    sys.stdin.readline()
    device.detach()
    print("released", flush=True)
""")


@pytest.fixture
def holder(isolated_ipu_host: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding device 0 (IPU 0) until told to let go."""
    env = {**os.environ, "IPUSERVE_SIM_LOCK_DIR": str(isolated_ipu_host)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().split() == ["held", "0"]
    with proc:  # closes the pipes
        yield proc
        proc.kill()


def _release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "released"


def test_no_wait_fails_while_another_process_holds_the_ipu(
    isolated_ipu_host: Path, holder: subprocess.Popen[str]
) -> None:
    dm = manager(isolated_ipu_host)
    with pytest.raises(
        DeviceUnavailableError,
        match=rf"without waiting \(NO_WAIT\).*in use .*: 0 \(pid {holder.pid}\);",
    ):
        dm.getSpecificDevice(0, wait_config=NO_WAIT)
    assert dm.tryGetSpecificDevice(4, wait_config=NO_WAIT) is None
    other = dm.getDevice(1, wait_config=NO_WAIT)  # IPU 1 is free
    assert other.getId() == 1
    # what this process holds itself is told apart from what others hold
    with pytest.raises(
        DeviceUnavailableError, match=rf": 0 \(pid {holder.pid}\), 1 \(this process\);"
    ):
        dm.getSpecificDevice(4, wait_config=NO_WAIT)
    other.detach()


def test_wait_with_timeout_gives_up(isolated_ipu_host: Path, holder: subprocess.Popen[str]) -> None:
    dm = manager(isolated_ipu_host)
    wait = DeviceWaitConfig(DeviceWaitStrategy.WAIT_WITH_TIMEOUT, timeout=0.2, sleepTime=0.05)
    with pytest.raises(DeviceUnavailableError, match=r"after waiting 0.2 s \(WAIT_WITH_TIMEOUT\)"):
        dm.getSpecificDevice(0, wait_config=wait)


class _Waiting(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("waiting for a free device"):
            self.started.set()


@pytest.mark.parametrize(
    "strategy", [DeviceWaitStrategy.WAIT_WITH_TIMEOUT, DeviceWaitStrategy.WAIT_FOREVER]
)
def test_waiting_strategies_get_the_ipu_once_released(
    isolated_ipu_host: Path, holder: subprocess.Popen[str], strategy: DeviceWaitStrategy
) -> None:
    dm = manager(isolated_ipu_host)
    waiting = _Waiting()
    logger = logging.getLogger("ipuserve.runtime.devices")
    logger.addHandler(waiting)
    logger.setLevel(logging.INFO)
    got: list[object] = []
    wait = DeviceWaitConfig(strategy, timeout=60, sleepTime=0.02)
    thread = threading.Thread(target=lambda: got.append(dm.getSpecificDevice(0, wait_config=wait)))
    try:
        thread.start()
        assert waiting.started.wait(30), "the manager never started waiting"
        _release(holder)
        thread.join(30)
    finally:
        logger.removeHandler(waiting)
    assert len(got) == 1 and got[0].getId() == 0  # type: ignore[attr-defined]
    got[0].detach()  # type: ignore[attr-defined]


def test_a_killed_holder_releases_its_ipus(
    isolated_ipu_host: Path, holder: subprocess.Popen[str]
) -> None:
    dm = manager(isolated_ipu_host)
    assert dm.tryGetSpecificDevice(0, wait_config=NO_WAIT) is None
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    device = dm.getSpecificDevice(0, wait_config=NO_WAIT)
    assert device.getId() == 0
    device.detach()


def test_the_runtime_logs_at_the_level_of_the_environment(isolated_ipu_host: Path) -> None:
    script = (
        "import ipuserve.runtime as mr\n"
        "from datetime import timedelta\n"
        "mr.DeviceManager().getDevice(1, wait_config=mr.DeviceWaitConfig(\n"
        "    mr.DeviceWaitStrategy.WAIT_WITH_TIMEOUT, timeout=0.01, sleepTime=0.005))\n"
    )
    holder = DeviceManager(SimulatorConfig(num_ipus=1, lock_dir=isolated_ipu_host)).getDevice(1)
    try:
        env = {
            **os.environ,
            "IPUSERVE_SIM_LOCK_DIR": str(isolated_ipu_host),
            "IPUSERVE_SIM_IPUS": "1",
        }
        quiet = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True
        )
        loud = subprocess.run(
            [sys.executable, "-c", script],
            env={**env, "IPUSERVE_LOG_LEVEL": "INFO"},
            capture_output=True,
            text=True,
        )
    finally:
        holder.detach()
    assert (
        "DeviceUnavailableError" in quiet.stderr and "waiting for a free device" not in quiet.stderr
    )
    assert "INFO" in loud.stderr and "waiting for a free device" in loud.stderr


def test_probing_who_holds_the_ipus_leaves_the_lock_files_as_they_were(
    isolated_ipu_host: Path,
) -> None:
    """A probe that locks and lets go must not sign the file: a holder that locked it a
    moment later would be named as this process until it signed it itself."""
    isolated_ipu_host.mkdir(parents=True, exist_ok=True)
    signed = isolated_ipu_host / "ipu2.lock"
    signed.write_text("12345\n")
    assert list(holders(isolated_ipu_host, 4)) == []  # nobody holds any
    assert signed.read_text() == "12345\n"


@pytest.mark.parametrize(
    ("args", "kwargs", "timeout_s", "sleep_s"),
    [
        ((timedelta(seconds=600),), {}, 600, 15),  # C++: DeviceWaitConfig(p_timeout)
        ((600,), {}, 600, 15),
        ((timedelta(seconds=600), timedelta(seconds=1)), {}, 600, 1),
        ((timedelta(seconds=600),), {"sleepTime": timedelta(seconds=2)}, 600, 2),
        ((DeviceWaitStrategy.WAIT_WITH_TIMEOUT,), {"timeout": 5}, 5, 15),
        ((DeviceWaitStrategy.WAIT_FOREVER,), {"sleepTime": 0}, 0, 0),
        ((), {}, 0, 15),
    ],
)
def test_device_wait_config_takes_the_spec_constructors(
    args: tuple[object, ...], kwargs: dict[str, object], timeout_s: float, sleep_s: float
) -> None:
    config = DeviceWaitConfig(*args, **kwargs)  # type: ignore[arg-type]
    shorthand = args and not isinstance(args[0], DeviceWaitStrategy)
    expected = DeviceWaitStrategy.WAIT_WITH_TIMEOUT if shorthand else None
    assert config.strategy is (expected or (args[0] if args else DeviceWaitStrategy.NO_WAIT))
    assert config.timeout == timedelta(seconds=timeout_s)
    assert config.sleepTime == timedelta(seconds=sleep_s)


def test_a_negative_wait_is_a_config_error_and_a_value_error() -> None:
    with pytest.raises(ConfigError, match="must be >= 0") as caught:
        DeviceWaitConfig(DeviceWaitStrategy.WAIT_WITH_TIMEOUT, timeout=-1)
    assert isinstance(caught.value, ValueError)
