"""How long a simulated IPU takes: the cost model and its constants.

A program run costs a fixed launch (host synchronisation) plus, per step, its
FLOPs at the IPU's sustained FLOP rate and its host-link bytes at the link's
bandwidth. The figures below are Graphcore's published peak numbers; the
sustained fraction and the launch cost are our estimates and are marked so.

Sources
-------
* Mk1 (GC2, arch version 1): 1216 tiles x 256 KiB In-Processor-Memory, 31.1 TFLOPS
  FP32 / 125 TFLOPS FP16 peak -- Graphcore C2 IPU-Processor card datasheet (2019).
* Mk2 (GC200 / Bow, arch version 2): 1472 tiles x 624 KiB = 897 MiB ("900 MB")
  In-Processor-Memory, 62.5 TFLOPS FP32 / 250 TFLOPS FP16 peak -- IPU-M2000
  datasheet (2020); the M2000 reaches its host over 100 GbE RoCEv2, i.e. 12.5 GB/s.
* C600 (arch version 21): 1472 tiles, 900 MB, 280 TFLOPS FP16 peak (FP32 taken as
  a quarter, as on Mk2) -- C600 PCIe card datasheet (2022); PCIe Gen4 x16 gives
  ~31.5 GB/s per direction.
* ``SUSTAINED_FRACTION`` (0.25): estimate. Small-batch inference reaches a fraction
  of peak; a quarter is in line with published MLPerf-inference IPU results.
* ``LAUNCH_SECONDS`` (10 us): estimate of one host sync (a PCIe / RoCE round trip
  plus Poplar's stream handshake); no public figure exists.

``IPUSERVE_SIM_TIME_SCALE`` multiplies every step's duration: it makes the model
slower, not the host, so the launch stays 10 us at any scale (0 = no simulated
time at all: runs take only as long as the numpy work does). :func:`time_scale_for`
picks the scale that makes a program take a given time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipuserve.errors import DeviceRequestError
from ipuserve.runtime.popef.types import Program, Step

KIB = 1024
MIB = 1024 * KIB

SUSTAINED_FRACTION = 0.25
LAUNCH_SECONDS = 10e-6


@dataclass(frozen=True)
class IpuSpec:
    """Published figures for one IPU of an architecture version."""

    version: int
    name: str
    tiles: int
    bytes_per_tile: int
    fp32_flops: float
    fp16_flops: float
    host_link_bytes_per_s: float

    @property
    def memory_bytes(self) -> int:
        return self.tiles * self.bytes_per_tile


IPU_SPECS: dict[int, IpuSpec] = {
    1: IpuSpec(1, "Mk1 (GC2)", 1216, 256 * KIB, 31.1e12, 125e12, 31.5e9),
    2: IpuSpec(2, "Mk2 (GC200)", 1472, 624 * KIB, 62.5e12, 250e12, 12.5e9),
    21: IpuSpec(21, "C600", 1472, 624 * KIB, 70e12, 280e12, 31.5e9),
}

#: Tiles of the "small" IPU Model (``createSmallIpuModelDevice``).
SMALL_MODEL_TILES = 4


def ipu_spec(version: int) -> IpuSpec:
    try:
        return IPU_SPECS[version]
    except KeyError:
        known = ", ".join(str(v) for v in IPU_SPECS)
        raise DeviceRequestError(
            f"unknown IPU architecture version {version}; known: {known}"
        ) from None


@dataclass(frozen=True)
class CostModel:
    """Turns a step's recorded FLOPs and host bytes into seconds on a device."""

    spec: IpuSpec
    num_ipus: int = 1
    time_scale: float = 1.0

    def launch_seconds(self) -> float:
        """The host sync: the host's cost, not the model's, so not scaled (0 without time)."""
        return LAUNCH_SECONDS if self.time_scale else 0.0

    def step_seconds(self, step: Step) -> float:
        if self.time_scale == 0:
            return 0.0
        seconds = step.host_bytes / self.spec.host_link_bytes_per_s
        if step.flops:
            half = str(step.attrs.get("dtype", "float32")) == "float16"
            peak = self.spec.fp16_flops if half else self.spec.fp32_flops
            seconds += step.flops / (peak * SUSTAINED_FRACTION * self.num_ipus)
        return seconds * self.time_scale

    def program_seconds(self, program: Program) -> float:
        """Estimated duration of one run; a switch counts its most expensive branch."""
        return self.launch_seconds() + _steps_seconds(self, program.steps)


def time_scale_for(target_seconds: float, estimated_seconds: float) -> float:
    """The time scale that makes a program estimated at ``estimated_seconds`` (scale 1,
    launch included, as ``ipuserve model inspect`` prints it) take ``target_seconds``.

    Only the steps scale; the launch does not (benchmarks pick their device time with it).
    """
    steps = estimated_seconds - LAUNCH_SECONDS
    if steps <= 0 or target_seconds <= LAUNCH_SECONDS:
        raise DeviceRequestError(
            f"no time scale makes a program estimated at {estimated_seconds * 1e6:.1f} us "
            f"take {target_seconds * 1e6:.1f} us (the launch alone is {LAUNCH_SECONDS * 1e6:g} us)"
        )
    return (target_seconds - LAUNCH_SECONDS) / steps


def _steps_seconds(model: CostModel, steps: tuple[Step, ...]) -> float:
    total = 0.0
    for step in steps:
        if step.op == "switch":
            total += max((_steps_seconds(model, b) for b in step.branches), default=0.0)
        else:
            total += model.step_seconds(step)
    return total
