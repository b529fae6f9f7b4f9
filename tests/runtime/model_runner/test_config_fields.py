"""One test (at least) per ModelRunnerConfig field, each checking what the spec says it does."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import numpy as np
import pytest

import ipuserve.runtime as model_runtime
from ipuserve.errors import (
    ConfigError,
    DeviceFaultError,
    DeviceUnavailableError,
    PackageHashError,
    RequestTimeoutError,
    RuntimeUsageError,
    TensorError,
)
from ipuserve.runtime.popef.types import Metadata, Model

from .conftest import WAIT_S, assert_matches, counts, reference, rows

NO_WAIT = model_runtime.DeviceWaitConfig(model_runtime.DeviceWaitStrategy.NO_WAIT)
MS = 1_000_000  # nanoseconds
FOREVER_NS = 3600 * 10**9


def simple_inputs(seed: int = 0, n: int = 2) -> dict[str, np.ndarray]:
    return {"tensor_A": rows(n, 4, seed), "tensor_B": rows(n, 4, seed + 1)}


def wait_for(condition, what: str) -> None:
    """Poll a condition that the system under test must reach (not a sleep for sync)."""
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.005)):
        if condition():
            return
        done.wait(0.005)
    raise AssertionError(f"never happened: {what}")


# -- every field of the spec's ModelRunnerConfig, with the spec's default ---------------

#: Section 10.1.3, ``struct ModelRunnerConfig``: every public member and its default.
SPEC_DEFAULTS = {
    "replication_factor": 1,
    "run_save_programs": False,
    "thread_safe": False,
    "frozen_inputs": {},
    "replica_to_save_programs_outputs": {},
    "replica_to_device": {},
    "check_package_hash": True,
    "timeout_ns": 5 * 10**9,  # std::chrono::seconds(5)
    "validate_io_params": True,
    "batching_dim": 0xFFFFFFFF,  # std::numeric_limits<unsigned>::max()
    "auto_reset": False,
    "max_look_ahead": "unlimited",
    "ring_buffer_size_multiplier": 2,
    "flush_on_waiting_outputs": False,
    "batch_size_timeout_ns": 2**63 - 1,  # std::chrono::nanoseconds::max()
    "data_parallel_timeout_ns": 2**63 - 1,
    "is_batch_size_timeout_enabled": False,
    "request_tracepoints_buffer_size": 1000,
    "flush_callback": None,
    "device_wait_config": None,  # DeviceWaitConfig{}: checked below
}


def test_every_spec_field_exists_with_the_spec_default(make_runner, simple: Model) -> None:
    config = model_runtime.ModelRunnerConfig()
    assert {f.name for f in dataclasses.fields(config)} == set(SPEC_DEFAULTS)
    in_use = make_runner(simple).config()
    for name, default in SPEC_DEFAULTS.items():
        if name != "device_wait_config":
            assert getattr(config, name) == default, name
            assert getattr(in_use, name) == default, name
    assert isinstance(config.frozen_inputs, model_runtime.InputMemoryView)
    wait = config.device_wait_config
    assert (wait.strategy, wait.timeout, wait.sleepTime) == (
        model_runtime.DeviceWaitStrategy.NO_WAIT,
        timedelta(0),
        timedelta(seconds=15),
    )


# -- replication_factor, replica_to_device, device_wait_config -------------------------


def test_replication_factor_gives_each_replica_its_own_device(make_runner, simple: Model) -> None:
    runner = make_runner(simple, replication_factor=2)
    for replica in range(2):
        inputs = simple_inputs(replica)
        assert_matches(
            runner.execute(inputs, replica_id=replica), reference("simple", simple, inputs)
        )
        assert counts(runner, replica)["request"] == 1
    names = {t.name for t in threading.enumerate()}
    assert {"ipu-device-0", "ipu-device-1"} <= names  # two devices, two threads, in parallel
    free = model_runtime.DeviceManager()
    assert free.tryGetSpecificDevice(0, wait_config=NO_WAIT) is None
    assert free.tryGetSpecificDevice(1, wait_config=NO_WAIT) is None


def test_replicas_run_independently(make_runner, mlp: Model) -> None:
    """Each replica has its own device loop: one waiting for data never holds up another."""
    runner = make_runner(mlp, replication_factor=2, batching_dim=0, timeout_ns=0)
    first = {"input": rows(3, 32, 20)}
    waiting = runner.executeAsync(first, replica_id=0)  # 3 of 16 samples, never flushed
    for i in range(5):
        inputs = {"input": rows(16, 32, 21 + i)}
        assert_matches(runner.execute(inputs, replica_id=1), reference("mlp", mlp, inputs))
    assert not waiting.done()
    rest = {"input": rows(13, 32, 30)}
    assert_matches(runner.execute(rest, replica_id=0), reference("mlp", mlp, rest))
    assert_matches(waiting.result(WAIT_S), reference("mlp", mlp, first))
    assert (counts(runner, 0)["batches"], counts(runner, 1)["batches"]) == (1, 5)


def test_more_replicas_than_ipus_fails_and_releases_everything(simple: Model) -> None:
    config = model_runtime.ModelRunnerConfig(replication_factor=5, device_wait_config=NO_WAIT)
    with pytest.raises(DeviceUnavailableError):
        model_runtime.ModelRunner(simple, config=config)
    everything = model_runtime.DeviceManager().getSpecificDevice(6, wait_config=NO_WAIT)
    everything.detach()


def test_replica_to_device_uses_the_given_devices_and_leaves_them_attached(simple: Model) -> None:
    manager = model_runtime.DeviceManager()
    devices = [manager.getSpecificDevice(2), manager.getSpecificDevice(3)]
    config = model_runtime.ModelRunnerConfig(
        replication_factor=2, replica_to_device=dict(enumerate(devices))
    )
    try:
        with model_runtime.ModelRunner(simple, config=config) as runner:
            assert {"ipu-device-2", "ipu-device-3"} <= {t.name for t in threading.enumerate()}
            inputs = simple_inputs(3)
            assert_matches(
                runner.execute(inputs, replica_id=1), reference("simple", simple, inputs)
            )
        assert all(d.isAttached() for d in devices)
        with model_runtime.ModelRunner(simple, config=config) as again:
            assert_matches(again.execute(inputs), reference("simple", simple, inputs))
    finally:
        for device in devices:
            device.detach()


def test_device_wait_config(simple: Model) -> None:
    holder = model_runtime.DeviceManager().getSpecificDevice(6)  # all four IPUs
    try:
        with pytest.raises(DeviceUnavailableError, match="NO_WAIT"):
            model_runtime.ModelRunner(
                simple, config=model_runtime.ModelRunnerConfig(device_wait_config=NO_WAIT)
            )
        waiting = model_runtime.DeviceWaitConfig(
            model_runtime.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
            timeout=timedelta(milliseconds=100),
            sleepTime=timedelta(milliseconds=20),
        )
        with pytest.raises(DeviceUnavailableError, match=r"after waiting 0\.1 s"):
            model_runtime.ModelRunner(
                simple, config=model_runtime.ModelRunnerConfig(device_wait_config=waiting)
            )
    finally:
        holder.detach()
    with model_runtime.ModelRunner(
        simple, config=model_runtime.ModelRunnerConfig(device_wait_config=NO_WAIT)
    ) as runner:
        assert runner.getExecuteInputs()


# -- thread_safe -----------------------------------------------------------------------


@pytest.mark.parametrize("thread_safe", [True, False])
def test_thread_safe_many_threads_share_one_runner(
    make_runner, simple: Model, thread_safe: bool
) -> None:
    """With thread_safe the runner-wide mutex serialises calls; ipuserve's per-replica lock
    keeps the queues consistent either way, so both settings must give every right answer."""
    runner = make_runner(simple, replication_factor=2, thread_safe=thread_safe)
    failures: list[str] = []

    def worker(worker_id: int) -> None:
        jobs = [(simple_inputs(worker_id * 100 + i), i % 2) for i in range(20)]
        futures = [runner.executeAsync(inputs, replica_id=r) for inputs, r in jobs]
        for (inputs, _), future in zip(jobs, futures, strict=True):
            want = reference("simple", simple, inputs)["output"]
            if not np.allclose(future.result(WAIT_S)["output"], want, rtol=1e-5, atol=1e-6):
                failures.append(f"worker {worker_id}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not failures
    assert counts(runner, 0)["request"] + counts(runner, 1)["request"] == 120


# -- frozen_inputs ---------------------------------------------------------------------


def test_frozen_input_is_no_longer_an_execute_input(make_runner, simple: Model) -> None:
    frozen_b = rows(2, 4, 40)
    runner = make_runner(simple, frozen_inputs=model_runtime.InputMemoryView(tensor_B=frozen_b))
    assert [d.name for d in runner.getExecuteInputs()] == ["tensor_A"]
    a = rows(2, 4, 41)
    got = runner.execute({"tensor_A": a})
    assert_matches(got, reference("simple", simple, {"tensor_A": a, "tensor_B": frozen_b}))
    with pytest.raises(TensorError, match="'tensor_B' is frozen"):
        runner.execute({"tensor_A": a, "tensor_B": frozen_b})


def test_frozen_input_overrides_popef_tensor_data(make_runner, simple: Model) -> None:
    weights = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    runner = make_runner(simple, frozen_inputs=model_runtime.InputMemoryView(weights=weights))
    inputs = simple_inputs(42)
    expected = inputs["tensor_A"] * weights + inputs["tensor_B"]
    np.testing.assert_allclose(runner.execute(inputs)["output"], expected, rtol=1e-6)


def test_frozen_input_must_match_its_anchor(simple: Model) -> None:
    config = model_runtime.ModelRunnerConfig(
        frozen_inputs=model_runtime.InputMemoryView(tensor_B=np.zeros((3, 4), np.float32))
    )
    with pytest.raises(TensorError, match=r"frozen input 'tensor_B': expected float32 \[2, 4\]"):
        model_runtime.ModelRunner(simple, config=config)


# -- validate_io_params ----------------------------------------------------------------


def test_validate_io_params_checks_every_call(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    with pytest.raises(TensorError, match="missing input tensor"):
        runner.execute({"tensor_A": rows(2, 4, 0)})


def test_conditional_execution_with_validation_off(make_runner, branches: Model) -> None:
    """Each request names one branch and gives only that branch's input (spec 3.5)."""
    runner = make_runner(branches, validate_io_params=False)
    for i in range(6):
        which = i % 2
        data = rows(1, 4 if which == 0 else 8, 50 + i)
        inputs = {
            "branch": np.array([which], np.int32),
            ("a_input" if which == 0 else "b_input"): data,
        }
        got = runner.execute(inputs)
        assert set(got) == {"a_output" if which == 0 else "b_output"}
        assert_matches(got, reference("branches", branches, inputs))


def test_with_validation_off_an_unknown_name_is_refused_before_anything_is_queued(
    make_runner, simple: Model
) -> None:
    """It once raised KeyError after queueing the request's other tensors: from then on
    each request got the result of the one before it."""
    runner = make_runner(simple, validate_io_params=False)
    good = simple_inputs(1)
    with pytest.raises(TensorError, match="unknown input tensor 'typo'"):
        runner.execute({**good, "typo": rows(2, 4, 9)})
    with pytest.raises(TensorError, match="unknown output tensor 'output_typo'"):
        runner.execute(good, {"output_typo": np.zeros((2, 4), np.float32)})
    for seed in (2, 3):
        inputs = simple_inputs(seed)
        assert_matches(runner.execute(inputs), reference("simple", simple, inputs))


def test_conditional_execution_needs_validation_off(make_runner, branches: Model) -> None:
    runner = make_runner(branches)
    with pytest.raises(TensorError, match=r"missing input tensor.*b_input"):
        runner.execute({"branch": np.array([0], np.int32), "a_input": rows(1, 4, 0)})


# -- batching_dim ----------------------------------------------------------------------


def test_without_batching_dim_the_batch_must_be_a_multiple(make_runner, mlp: Model) -> None:
    runner = make_runner(mlp)
    with pytest.raises(TensorError, match=r"not a multiple of the compiled batch 16.*batching_dim"):
        runner.execute({"input": rows(5, 32, 0)})
    inputs = {"input": rows(32, 32, 1)}
    assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))


def test_batching_dim_0_accepts_any_batch_size(make_runner, mlp: Model) -> None:
    runner = make_runner(mlp, batching_dim=0, timeout_ns=5 * MS)
    for n in (1, 5, 16, 17, 40):
        inputs = {"input": rows(n, 32, n)}
        got = runner.execute(inputs)
        assert got["logits"].shape == (n, 10)
        assert_matches(got, reference("mlp", mlp, inputs))


def test_batching_dim_1(make_runner) -> None:
    from ipuserve.runtime.popef import examples

    model = examples.build("simple", batch_size=3, batch_dim=1)
    runner = make_runner(model, batching_dim=1, timeout_ns=5 * MS)
    futures = []
    for n in (1, 2, 4):
        inputs = {"tensor_A": rows(4, n, n).reshape(4, n), "tensor_B": rows(4, n, n + 9)}
        futures.append((inputs, runner.executeAsync(inputs)))
    for inputs, future in futures:
        got = future.result(WAIT_S)
        assert got["output"].shape == (4, inputs["tensor_A"].shape[1])
        want = examples.reference("simple", inputs, examples.tensor_arrays(model), batch_dim=1)
        assert_matches(got, want)


def test_batching_dim_out_of_range(mlp: Model) -> None:
    with pytest.raises(ConfigError, match="batching_dim=2 is out of range for tensor 'input'"):
        model_runtime.ModelRunner(mlp, config=model_runtime.ModelRunnerConfig(batching_dim=2))


def test_batching_dim_must_hold_the_batch_of_every_tensor(mlp: Model) -> None:
    """Dimension 1 of the MLP's tensors is features (32 in, 10 out), not the batch."""
    with pytest.raises(
        ConfigError, match=r"batching_dim=1: .*disagree.*input has 32, logits has 10"
    ):
        model_runtime.ModelRunner(mlp, config=model_runtime.ModelRunnerConfig(batching_dim=1))


# -- timeouts and flushing ---------------------------------------------------------------


def test_timeout_ns_flushes_a_lone_partial_batch(make_runner, mlp: Model) -> None:
    runner = make_runner(mlp, batching_dim=0, timeout_ns=10 * MS)
    inputs = {"input": rows(3, 32, 60)}
    assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))
    stats = counts(runner)
    assert stats["flushed_batches"] >= 1 and stats["padded_samples"] >= 13


def test_timeout_ns_zero_waits_for_the_batch_to_fill(make_runner, mlp: Model) -> None:
    calls: list[str] = []
    runner = make_runner(
        mlp, batching_dim=0, timeout_ns=0, flush_callback=lambda tensor, i, o: calls.append(tensor)
    )
    first = {"input": rows(3, 32, 61)}
    pending = runner.executeAsync(first)
    with pytest.raises(RequestTimeoutError, match="waiting for input tensor 'input'"):
        pending.wait(0.05)  # nothing can complete it yet: 3 of 16 samples, no flush ever
    rest = {"input": rows(13, 32, 62)}
    assert_matches(runner.execute(rest), reference("mlp", mlp, rest))
    assert_matches(pending.result(WAIT_S), reference("mlp", mlp, first))
    assert calls == [] and counts(runner)["padded_samples"] == 0


def test_batch_size_timeout_applies_when_enabled(make_runner, mlp: Model) -> None:
    runner = make_runner(
        mlp,
        batching_dim=0,
        timeout_ns=FOREVER_NS,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=5 * MS,
    )
    inputs = {"input": rows(2, 32, 63)}
    assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))
    assert counts(runner)["padded_samples"] == 14


def test_an_eager_flush_tells_the_callback_which_input_it_expected(make_runner, mlp: Model) -> None:
    """Spec 3.7: tensor_id is "the ID of the tensor that ModelRunner was expecting when
    the timeout occurred" (an eager flush once passed 'device idle')."""
    calls: list[str] = []
    runner = make_runner(
        mlp,
        batching_dim=0,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=0,
        flush_callback=lambda tensor, _i, _o: calls.append(tensor),
    )
    inputs = {"input": rows(3, 32, 80)}
    assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))
    assert calls == ["input"]


def test_batch_size_timeouts_are_ignored_unless_enabled(make_runner, mlp: Model) -> None:
    """is_batch_size_timeout_enabled=False: a partial batch waits timeout_ns (an hour here),
    not batch_size_timeout_ns or data_parallel_timeout_ns."""
    calls: list[str] = []
    runner = make_runner(
        mlp,
        batching_dim=0,
        timeout_ns=FOREVER_NS,
        batch_size_timeout_ns=1 * MS,
        data_parallel_timeout_ns=1 * MS,
        flush_callback=lambda tensor, _i, _o: calls.append(tensor),
    )
    first = {"input": rows(3, 32, 72)}
    pending = runner.executeAsync(first)
    with pytest.raises(RequestTimeoutError, match="waiting for input tensor 'input'"):
        pending.wait(0.05)  # fifty times batch_size_timeout_ns, and still not flushed
    rest = {"input": rows(13, 32, 73)}
    assert_matches(runner.execute(rest), reference("mlp", mlp, rest))
    assert_matches(pending.result(WAIT_S), reference("mlp", mlp, first))
    assert calls == [] and counts(runner)["padded_samples"] == 0


def test_data_parallel_timeout_applies_with_replication(make_runner, mlp: Model) -> None:
    runner = make_runner(
        mlp,
        replication_factor=2,
        batching_dim=0,
        timeout_ns=FOREVER_NS,
        is_batch_size_timeout_enabled=True,
        data_parallel_timeout_ns=timedelta(milliseconds=5),
    )
    inputs = {"input": rows(4, 32, 64)}
    assert_matches(runner.execute(inputs, replica_id=1), reference("mlp", mlp, inputs))
    assert counts(runner, 1)["padded_samples"] == 12


def test_flush_callback_is_called_once_with_what_will_be_flushed(make_runner, mlp: Model) -> None:
    seen: list[tuple[str, dict[str, tuple[int, ...]], list[str]]] = []

    def flush(
        tensor_id: str,
        inputs: model_runtime.InputMemoryView,
        outputs: model_runtime.OutputMemoryView,
    ) -> None:
        seen.append((tensor_id, {k: v.shape for k, v in inputs.items()}, sorted(outputs)))

    runner = make_runner(
        mlp,
        batching_dim=0,
        flush_on_waiting_outputs=True,
        is_batch_size_timeout_enabled=True,
        batch_size_timeout_ns=5 * MS,
        flush_callback=flush,
    )
    inputs = {"input": rows(5, 32, 65)}
    assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))
    assert seen == [("input", {"input": (11, 32)}, ["logits", "probs"])]


def test_flush_callback_can_flush_nothing(make_runner, mlp: Model) -> None:
    """Emptying the views flushes nothing: the partial batch keeps waiting for real data."""
    calls = threading.Semaphore(0)

    def flush_nothing(
        _tensor: str, inputs: model_runtime.InputMemoryView, outputs: model_runtime.OutputMemoryView
    ) -> None:
        inputs.clear()
        outputs.clear()
        calls.release()

    runner = make_runner(mlp, batching_dim=0, timeout_ns=2 * MS, flush_callback=flush_nothing)
    first = {"input": rows(6, 32, 66)}
    pending = runner.executeAsync(first)
    for _ in range(3):
        assert calls.acquire(timeout=WAIT_S)
    assert not pending.done()  # three timeouts, nothing flushed, so it must still wait
    rest = {"input": rows(10, 32, 67)}
    assert_matches(runner.execute(rest), reference("mlp", mlp, rest))
    assert_matches(pending.result(WAIT_S), reference("mlp", mlp, first))
    assert counts(runner)["padded_samples"] == 0


def test_flush_callback_may_return_replacement_views(make_runner, mlp: Model) -> None:
    def replace(
        _tensor: str, inputs: model_runtime.InputMemoryView, outputs: model_runtime.OutputMemoryView
    ):
        return (model_runtime.InputMemoryView(inputs), model_runtime.OutputMemoryView(outputs))

    runner = make_runner(mlp, batching_dim=0, timeout_ns=2 * MS, flush_callback=replace)
    inputs = {"input": rows(7, 32, 68)}
    assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))


def test_flush_on_waiting_outputs_false_flushes_even_when_idle(make_runner, mlp: Model) -> None:
    runner = make_runner(mlp, batching_dim=0, timeout_ns=2 * MS, flush_on_waiting_outputs=False)
    wait_for(lambda: counts(runner)["batches"] >= 2, "dummy batches while idle")
    assert counts(runner)["request"] == 0 and counts(runner)["flushed_batches"] >= 2


def test_flush_on_waiting_outputs_true_flushes_only_for_waiting_requests(
    make_runner, mlp: Model
) -> None:
    runner = make_runner(mlp, batching_dim=0, timeout_ns=2 * MS, flush_on_waiting_outputs=True)
    wait_for(lambda: counts(runner)["read_timeouts"] >= 3, "idle read timeouts")
    assert counts(runner)["batches"] == 0 and counts(runner)["flushed_batches"] == 0
    inputs = {"input": rows(1, 32, 69)}
    assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))
    assert counts(runner)["flushed_batches"] == 1


# -- queues ----------------------------------------------------------------------------


@pytest.mark.parametrize("multiplier", [1, 3])
def test_ring_buffer_size_multiplier(make_runner, mlp: Model, multiplier: int) -> None:
    runner = make_runner(mlp, ring_buffer_size_multiplier=multiplier)
    queue = runner._replicas[0].queues.inputQueue("input")
    assert queue.numBuffers() == multiplier * 16
    inputs = {"input": rows(64, 32, 70)}
    assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))


@pytest.mark.parametrize(
    ("look_ahead", "prefetched"), [("unlimited", True), ("2", True), ("0", False)]
)
def test_max_look_ahead_decides_who_reads_the_inputs(
    make_runner, mlp: Model, look_ahead: str, prefetched: bool
) -> None:
    """With look-ahead a prefetch thread assembles batches ahead of the device; with 0 the
    device thread reads each batch itself when the run needs it."""
    readers: list[str] = []
    runner = make_runner(
        mlp,
        batching_dim=0,
        timeout_ns=2 * MS,
        max_look_ahead=look_ahead,
        flush_callback=lambda *_: readers.append(threading.current_thread().name),
    )
    inputs = {"input": rows(3, 32, 71)}
    assert_matches(runner.execute(inputs), reference("mlp", mlp, inputs))
    assert readers and readers[0].endswith("-prefetch") == prefetched


def test_max_look_ahead_must_be_unlimited_or_a_count(mlp: Model) -> None:
    with pytest.raises(ConfigError, match="max_look_ahead"):
        model_runtime.ModelRunner(mlp, config=model_runtime.ModelRunnerConfig(max_look_ahead="-1"))


# -- monitoring buffer ---------------------------------------------------------------------


def test_request_tracepoints_buffer_size(make_runner, simple: Model) -> None:
    runner = make_runner(simple, request_tracepoints_buffer_size=5)
    for i in range(12):
        runner.execute(simple_inputs(i))
    trace: dict[str, float] = {}
    runner.getTimeTrace(trace, cur=-5)
    assert set(trace) == {
        "request_duration_us",
        "read_preparation_duration_us",
        "read_queue_duration_us",
        "computation_duration_us",
    }
    with pytest.raises(IndexError, match="holds the last 5 requests"):
        runner.getTimeTrace({}, cur=-6)
    assert counts(runner)["request"] == 12


# -- auto_reset ----------------------------------------------------------------------------


@pytest.mark.parametrize("auto_reset", [False, True])
def test_auto_reset(simple: Model, auto_reset: bool) -> None:
    device = model_runtime.DeviceManager().getDevice(1)
    config = model_runtime.ModelRunnerConfig(replica_to_device={0: device}, auto_reset=auto_reset)
    try:
        with model_runtime.ModelRunner(simple, config=config) as runner:
            inputs = simple_inputs(80)
            assert_matches(runner.execute(inputs), reference("simple", simple, inputs))
            device.injectFault()
            with pytest.raises(DeviceFaultError, match="application runtime error"):
                runner.execute(inputs)
            if auto_reset:
                assert_matches(runner.execute(inputs), reference("simple", simple, inputs))
            else:
                with pytest.raises(RuntimeUsageError, match="auto_reset"):
                    runner.execute(inputs)
    finally:
        device.detach()


# -- save programs ------------------------------------------------------------------------


@pytest.mark.parametrize("run_save_programs", [True, False])
def test_run_save_programs(simple: Model, run_save_programs: bool) -> None:
    counter = np.full(1, -1, np.int64)
    config = model_runtime.ModelRunnerConfig(
        replication_factor=2,
        run_save_programs=run_save_programs,
        replica_to_save_programs_outputs={1: model_runtime.OutputMemoryView(run_count=counter)},
    )
    runner = model_runtime.ModelRunner(simple, config=config)
    for i in range(3):
        runner.execute(simple_inputs(i, n=4), replica_id=1)  # two runs each
    runner.close()
    runs = counts(runner, 1)["batches"]
    assert runs >= 6
    assert counter[0] == (runs if run_save_programs else -1)


# -- check_package_hash ------------------------------------------------------------------


def _with_executable_hash(model: Model, digest: str) -> Model:
    meta = model.metadata
    forged = Metadata(
        model_name=meta.modelName(),
        executable=meta.executable(),
        anchors=meta.anchors(),
        program_flow=meta.programFlow(),
        num_ipus=meta.numIpus(),
        ipu_version=meta.ipuVersion(),
        batch_size=meta.batchSize(),
        executable_hash=digest,
    )
    return Model(forged, model.executable, model.tensorData)


def test_check_package_hash(make_runner, simple: Model) -> None:
    forged = _with_executable_hash(simple, "0" * 64)
    with pytest.raises(PackageHashError, match="0000000000"):
        model_runtime.ModelRunner(forged)
    runner = make_runner(forged, check_package_hash=False)
    inputs = simple_inputs(90)
    assert_matches(runner.execute(inputs), reference("simple", simple, inputs))


def test_config_is_validated_with_field_names(simple: Model) -> None:
    for field, value, message in [
        ("replication_factor", 0, "replication_factor must be an integer >= 1"),
        ("ring_buffer_size_multiplier", 0, "ring_buffer_size_multiplier"),
        ("timeout_ns", -1, "timeout_ns: expected nanoseconds"),
        ("request_tracepoints_buffer_size", -1, "request_tracepoints_buffer_size"),
        ("request_tracepoints_buffer_size", 1.5, "request_tracepoints_buffer_size"),
        ("batching_dim", -1, "batching_dim must be an integer >= 0"),
        ("replica_to_device", {3: None}, "names replica 3"),
    ]:
        config = model_runtime.ModelRunnerConfig()
        setattr(config, field, value)
        with pytest.raises(ConfigError, match=message):
            model_runtime.ModelRunner(simple, config=config)


def test_idle_flushes_never_strand_padding_in_a_conditional_model(
    make_runner, branches: Model
) -> None:
    """An idle conditional model must not pad branches a run will not read (it would fill
    their queues and misalign their next requests)."""
    runner = make_runner(branches, validate_io_params=False, timeout_ns=1 * MS)
    first = {"branch": np.array([0], np.int32), "a_input": rows(1, 4, 1)}
    assert_matches(runner.execute(first), reference("branches", branches, first))
    wait_for(lambda: counts(runner)["read_timeouts"] >= 50, "many idle timeouts")
    second = {"branch": np.array([1], np.int32), "b_input": rows(1, 8, 2)}
    assert_matches(runner.execute(second), reference("branches", branches, second))
    assert counts(runner)["flushed_batches"] == 0


def test_positional_replica_id_like_the_cpp_overload(make_runner, simple: Model) -> None:
    runner = make_runner(simple, replication_factor=2)
    inputs = simple_inputs(95)
    assert_matches(runner.execute(inputs, 1), reference("simple", simple, inputs))
    assert_matches(
        runner.executeAsync(inputs, 1).result(WAIT_S), reference("simple", simple, inputs)
    )
    assert counts(runner, 1)["request"] == 2 and counts(runner, 0)["request"] == 0


def test_batch_counts_never_lag_behind_results(make_runner, simple: Model) -> None:
    runner = make_runner(simple)
    for i in range(1, 30):
        runner.execute(simple_inputs(i))
        assert counts(runner)["batches"] >= i
