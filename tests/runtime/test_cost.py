"""The cost model: simulated seconds from recorded FLOPs and host bytes, and their scale.

Checked against the formula written down in docs/runtime.md (launch + FLOPs at the
sustained rate + bytes over the host link, the steps times IPUSERVE_SIM_TIME_SCALE), with the
published figures spelled out here so a changed constant shows up as a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ipuserve.errors import DeviceRequestError
from ipuserve.runtime.devices import DeviceManager
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.types import Program, Step
from ipuserve.runtime.simulator.config import SimulatorConfig
from ipuserve.runtime.simulator.cost import (
    LAUNCH_SECONDS,
    SUSTAINED_FRACTION,
    CostModel,
    ipu_spec,
    time_scale_for,
)

MK2 = ipu_spec(2)


def test_published_mk2_figures() -> None:
    assert (MK2.tiles, MK2.bytes_per_tile) == (1472, 624 * 1024)
    assert MK2.memory_bytes == 1472 * 624 * 1024  # 897 MiB, the "900 MB" of the datasheet
    assert (MK2.fp32_flops, MK2.fp16_flops, MK2.host_link_bytes_per_s) == (62.5e12, 250e12, 12.5e9)
    assert (SUSTAINED_FRACTION, LAUNCH_SECONDS) == (0.25, 10e-6)


def test_a_step_costs_its_flops_at_the_sustained_rate_and_its_bytes_over_the_link() -> None:
    cost = CostModel(MK2)
    fp32 = Step("matmul", ("a", "b"), "c", attrs={"dtype": "float32"}, flops=10**9)
    fp16 = Step("matmul", ("a", "b"), "c", attrs={"dtype": "float16"}, flops=10**9)
    stream = Step("stream_in", (), "x", anchor="x", host_bytes=10**6)
    assert cost.step_seconds(fp32) == pytest.approx(1e9 / (62.5e12 * 0.25))
    assert cost.step_seconds(fp16) == pytest.approx(1e9 / (250e12 * 0.25))
    assert cost.step_seconds(stream) == pytest.approx(1e6 / 12.5e9)
    # compute spreads over the IPUs of a multi-IPU device; the host link does not
    pair = CostModel(MK2, num_ipus=2)
    assert pair.step_seconds(fp32) == pytest.approx(cost.step_seconds(fp32) / 2)
    assert pair.step_seconds(stream) == pytest.approx(cost.step_seconds(stream))


def test_a_program_costs_its_launch_plus_its_steps_and_a_switch_its_costliest_branch() -> None:
    cheap = (Step("relu", ("x",), "y", attrs={"dtype": "float32"}, flops=1000),)
    dear = (Step("matmul", ("x", "w"), "y", attrs={"dtype": "float32"}, flops=10**8),)
    program = Program(
        1,
        "main",
        (
            Step("stream_in", (), "x", anchor="x", host_bytes=4096),
            Step("switch", ("s",), branches=(cheap, dear)),
        ),
    )
    cost = CostModel(MK2)
    expected = 10e-6 + 4096 / 12.5e9 + 1e8 / (62.5e12 * 0.25)
    assert cost.program_seconds(program) == pytest.approx(expected)


@pytest.mark.parametrize("scale", [0.5, 400.0])
def test_the_time_scale_slows_the_model_not_the_host(scale: float) -> None:
    """Every step's duration is multiplied; the launch (a host sync) stays 10 us."""
    main = examples.build("mlp").executable.program(1)
    steps = CostModel(MK2).program_seconds(main) - LAUNCH_SECONDS
    scaled = CostModel(MK2, time_scale=scale)
    assert scaled.launch_seconds() == LAUNCH_SECONDS
    assert scaled.program_seconds(main) == pytest.approx(LAUNCH_SECONDS + steps * scale)


def test_a_time_scale_of_zero_takes_no_time_at_all() -> None:
    main = examples.build("mlp").executable.program(1)
    assert CostModel(MK2, time_scale=0.0).program_seconds(main) == 0.0


@pytest.mark.parametrize("target_s", [2e-3, 5e-3, 25e-6])
def test_time_scale_for_gives_the_scale_that_makes_a_program_take_a_time(target_s: float) -> None:
    main = examples.build("mlp").executable.program(1)
    scale = time_scale_for(target_s, CostModel(MK2).program_seconds(main))
    assert CostModel(MK2, time_scale=scale).program_seconds(main) == pytest.approx(target_s)


def test_no_time_scale_makes_a_program_faster_than_its_launch() -> None:
    with pytest.raises(DeviceRequestError, match="the launch alone"):
        time_scale_for(5e-6, 18e-6)


def test_the_mlp_example_runs_in_about_18_us_on_a_simulated_mk2() -> None:
    """The figure docs/runtime.md quotes (60 MFLOP and 50 KiB of I/O per batch of 16)."""
    main = examples.build("mlp").executable.program(1)
    assert CostModel(MK2).program_seconds(main) == pytest.approx(17.95e-6, rel=0.01)


def test_devices_take_the_time_scale_of_the_environment(
    isolated_ipu_host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IPUSERVE_SIM_TIME_SCALE", "3")
    manager = DeviceManager()
    device = manager.getDevice(1)
    ipu_model = manager.createIpuModelDevice(1)
    try:
        assert device.cost.time_scale == 3.0
        assert ipu_model.cost.time_scale == 0.0  # an IPU Model takes no simulated time
    finally:
        device.detach()
        ipu_model.detach()
    configured = DeviceManager(SimulatorConfig(time_scale=0.0, lock_dir=isolated_ipu_host))
    fast = configured.getDevice(1)
    assert fast.cost.time_scale == 0.0 and fast.cost.launch_seconds() == 0.0
    fast.detach()
