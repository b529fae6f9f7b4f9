#!/usr/bin/env python3
# Copyright (c) 2022 Graphcore Ltd. All rights reserved.
"""
The example shows the monitoring statistics of ModelRunner (spec section 3.8),
read per replica while the model serves requests:

  * getTimeTrace: how long each phase of the last request took;
  * getMonitoringStatisticsPercentile: a percentile of each phase's latency,
    here P99.9 (quantile 0.999);
  * getMonitoringStatisticsMean: the mean latency of each phase;
  * getMonitoringStatisticsTotalCount: how many requests each phase has seen.

The phases: read preparation (from the execute call until the request is
queued), read queue (until the device starts reading it), computation (until
its outputs are written) and the whole request. All values are microseconds;
means and percentiles cover the last `request_tracepoints_buffer_size`
requests. Each dictionary passed in should be empty; it is filled and returned.

It expects one of the example models, e.g. `ipuserve model example simple
simple.popef` (or `mlp`, for longer computations), and two free IPUs.
"""

import argparse
import sys
from datetime import timedelta

import numpy as np

import ipuserve.runtime as model_runtime
from ipuserve.runtime import popef

NUM_REPLICAS = 2
REQUESTS_PER_REPLICA = 50


def main():
    parser = argparse.ArgumentParser("Model runner monitoring example.")
    parser.add_argument(
        "-p",
        "--popef",
        type=str,
        metavar='popef_file_path',
        help="A collection of PopEF files containing the model.",
        nargs='+',
        required=True)
    args = parser.parse_args()

    config = model_runtime.ModelRunnerConfig()
    config.replication_factor = NUM_REPLICAS
    # Tracepoints of the last 1000 requests; the spec records them only when
    # flush_on_waiting_outputs is set.
    config.request_tracepoints_buffer_size = 1000
    config.flush_on_waiting_outputs = True
    config.device_wait_config = model_runtime.DeviceWaitConfig(
        model_runtime.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
        timeout=timedelta(seconds=600),
        sleepTime=timedelta(seconds=1))

    print("Creating ModelRunner with", config)
    model_runner = model_runtime.ModelRunner(model_runtime.PopefPaths(args.popef),
                                             config=config)
    input_descriptions = model_runner.getExecuteInputs()

    print(f"Sending {REQUESTS_PER_REPLICA} asynchronous requests to each of "
          f"{NUM_REPLICAS} replicas")
    requests = []
    for request_id in range(REQUESTS_PER_REPLICA * NUM_REPLICAS):
        replica_id = request_id % NUM_REPLICAS
        input_view = model_runtime.InputMemoryView()
        for desc in input_descriptions:
            input_view[desc.name] = np.random.randn(*desc.shape).astype(
                desc.numpy_data_type())
        requests.append((input_view, model_runner.executeAsync(input_view, replica_id=replica_id)))

    reference = Reference(args.popef)
    for input_view, future in requests:
        future.wait()
        reference.check(input_view, future)
    if reference.known:
        print(f"Verified {len(requests)} results against the numpy reference.")

    for replica_id in range(NUM_REPLICAS):
        print(f"Replica {replica_id}:")
        time_trace = model_runner.getTimeTrace({}, replica_id=replica_id)
        show("time trace of the last request", time_trace)
        percentile = model_runner.getMonitoringStatisticsPercentile(
            {}, 0.999, replica_id=replica_id)
        show("P99.9 latency", percentile)
        mean = model_runner.getMonitoringStatisticsMean({}, replica_id=replica_id)
        show("mean latency", mean)
        count = model_runner.getMonitoringStatisticsTotalCount({}, replica_id=replica_id)
        show("total count", count)
        check_statistics(replica_id, time_trace, percentile, mean, count)

    print("Success: exiting")
    return 0


def show(title, statistics):
    print(f"\t{title}:")
    for name, value in statistics.items():
        print(f"\t\t{name}: {value:.1f}")


# -- ipuserve: checking the results and the statistics ------------------------------

PHASES = ("request", "read_preparation", "read_queue", "computation")


def check_statistics(replica_id, time_trace, percentile, mean, count):
    """Exit with status 1 unless the statistics agree with what was sent."""
    for phase in PHASES:
        seen = count[f"{phase}_monitoring_statistics_count"]
        if seen != REQUESTS_PER_REPLICA:
            sys.exit(f"FAILED: replica {replica_id} counted {seen} requests in phase "
                     f"{phase}, but {REQUESTS_PER_REPLICA} were sent to it")
        # Over 50 values, the interpolated P99.9 lies between the two largest,
        # so it cannot be below the mean.
        p, m = (percentile[f"{phase}_monitoring_statistics_percentile_us"],
                mean[f"{phase}_monitoring_statistics_mean_us"])
        if not p >= m:
            sys.exit(f"FAILED: replica {replica_id}: {phase} P99.9 {p} < mean {m}")
    if time_trace["computation_duration_us"] > time_trace["request_duration_us"]:
        sys.exit(f"FAILED: replica {replica_id}: the last request's computation "
                 "took longer than the whole request")
    print(f"\tVerified: {REQUESTS_PER_REPLICA} requests counted in every phase.")


class Reference:
    """The model's outputs computed with numpy alone (ipuserve's example models)."""

    def __init__(self, popef_paths):
        model = popef.load_model(popef_paths)
        self.name = model.metadata.modelName()
        self.tensor_data = popef.examples.tensor_arrays(model)
        self.known = self.name in popef.examples.EXAMPLES
        if not self.known:
            print("Model", self.name, "is not an example model: results are not verified.")

    def check(self, inputs, outputs):
        """Exit with status 1 unless ``outputs`` match the numpy reference."""
        if not self.known:
            return
        expected = popef.examples.reference(self.name, inputs, self.tensor_data)
        for name, want in expected.items():
            got = np.asarray(outputs[name])
            if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                sys.exit(f"FAILED: output {name} differs from the numpy reference:\n"
                         f"{got}\nexpected:\n{want}")


if __name__ == "__main__":
    sys.exit(main())
