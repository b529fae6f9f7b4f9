"""What the simulated host looks like: how many IPUs, which version, how fast time runs.

Read from the environment once per :class:`~ipuserve.runtime.DeviceManager`
(the edge of the runtime: there is no CLI in between when the runtime is used
as a library, exactly like the real library reads its ``POPLAR_*`` variables):

``IPUSERVE_SIM_IPUS``
    ``COUNT`` or ``COUNT:VERSION`` -- e.g. ``4`` (default: 4 Mk2 IPUs), ``8:21``
    (8 C600s). ``0`` is a host without IPUs.
``IPUSERVE_SIM_TIME_SCALE``
    Multiplier on every step's simulated duration, not the launch (a host sync):
    it slows the model, not the host (default 1; 0 = as fast as the host can).
``IPUSERVE_SIM_LOCK_DIR``
    Directory holding one lock file per IPU; processes sharing it share the IPUs
    (default: a per-user directory under the system temp dir).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ipuserve.errors import ConfigError
from ipuserve.runtime.simulator.cost import IPU_SPECS

IPUS_ENV = "IPUSERVE_SIM_IPUS"
TIME_SCALE_ENV = "IPUSERVE_SIM_TIME_SCALE"
LOCK_DIR_ENV = "IPUSERVE_SIM_LOCK_DIR"
BLAS_THREADS_ENV = "IPUSERVE_SIM_BLAS_THREADS"

DEFAULT_NUM_IPUS = 4
DEFAULT_IPU_VERSION = 2


def default_lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"ipuserve-sim-{os.getuid()}"


@dataclass(frozen=True)
class SimulatorConfig:
    num_ipus: int = DEFAULT_NUM_IPUS
    ipu_version: int = DEFAULT_IPU_VERSION
    time_scale: float = 1.0
    lock_dir: Path | None = None

    @property
    def locks(self) -> Path:
        return self.lock_dir if self.lock_dir is not None else default_lock_dir()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SimulatorConfig:
        env = os.environ if environ is None else environ
        # empty means unset, as for the CLI's variables (compose.yaml passes them empty)
        num_ipus, version = parse_ipus(env.get(IPUS_ENV) or str(DEFAULT_NUM_IPUS))
        lock_dir = env.get(LOCK_DIR_ENV)
        return cls(
            num_ipus=num_ipus,
            ipu_version=version,
            time_scale=parse_time_scale(env.get(TIME_SCALE_ENV) or "1"),
            lock_dir=Path(lock_dir) if lock_dir else None,
        )


def parse_ipus(text: str) -> tuple[int, int]:
    """``"4"`` -> (4, 2); ``"8:21"`` -> (8, 21)."""
    count_text, _, version_text = text.strip().partition(":")
    try:
        count = int(count_text)
        version = int(version_text) if version_text else DEFAULT_IPU_VERSION
    except ValueError:
        raise ConfigError(
            f"{IPUS_ENV}={text!r}: expected COUNT or COUNT:VERSION, e.g. 4 or 8:21"
        ) from None
    if count < 0 or count > 1024:
        raise ConfigError(f"{IPUS_ENV}={text!r}: the IPU count must be between 0 and 1024")
    if version not in IPU_SPECS:
        known = ", ".join(str(v) for v in IPU_SPECS)
        raise ConfigError(f"{IPUS_ENV}={text!r}: unknown IPU version {version}; known: {known}")
    return count, version


def parse_blas_threads(text: str) -> int:
    """BLAS threads per simulated device (:mod:`ipuserve.runtime.simulator.blas`)."""
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ConfigError(f"{BLAS_THREADS_ENV}={text!r}: expected a whole number >= 1")
    return threads


def parse_time_scale(text: str) -> float:
    try:
        scale = float(text)
    except ValueError:
        raise ConfigError(f"{TIME_SCALE_ENV}={text!r}: expected a number >= 0") from None
    if scale < 0 or scale != scale:
        raise ConfigError(f"{TIME_SCALE_ENV}={text!r}: expected a number >= 0")
    return scale
