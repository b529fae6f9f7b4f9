#!/usr/bin/env python3
# Copyright (c) 2022 Graphcore Ltd. All rights reserved.
# ipuserve: spec listing 3.6 with only its imports changed, plus a check of every
# request's result against a plain-numpy computation of the model.
"""
The example shows loading a model from PopEF files and sending inference
requests to the same model by multiple threads.

With ``thread_safe`` set, every execute call locks the runner, so the requests
of all threads share one replica's queues safely. Every request gets its own
random input, so a result handed to the wrong request would not match the
numpy reference of its own input.
"""

import argparse
import sys
import threading
from datetime import timedelta

import numpy as np

import ipuserve.runtime as model_runtime
from ipuserve.runtime import popef

# ipuserve: mismatches found by the worker threads (a thread cannot set the exit
# status, so main() reports them).
failures = []


def main():
    parser = argparse.ArgumentParser("Model runner simple example.")
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
    config.thread_safe = True
    config.device_wait_config = model_runtime.DeviceWaitConfig(
        model_runtime.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
        timeout=timedelta(seconds=600),
        sleepTime=timedelta(seconds=1))

    print("Creating ModelRunner with", config)
    model_runner = model_runtime.ModelRunner(model_runtime.PopefPaths(
        args.popef),
                                             config=config)
    reference = Reference(args.popef)
    num_workers = 4
    print("Starting", num_workers, "worker threads.")
    threads = [
        threading.Thread(target=runWorker,
                         args=(model_runner, worker_id, reference))
        for worker_id in range(num_workers)
    ]

    for thread in threads:
        thread.start()

    for thread in threads:
        thread.join()

    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    if reference.known:
        print("Verified", reference.checked, "results against the numpy reference.")
    print("Success: exiting")
    return 0


def workerMain(model_runner, worker_id, reference):
    print("Worker", worker_id, "Starting workerMain()")
    num_requests = 5

    input_descriptions = model_runner.getExecuteInputs()
    input_requests = []

    print("Worker", worker_id, "Allocating input tensors for", num_requests,
          "requests", input_descriptions)
    for _ in range(num_requests):
        input_requests.append([
            np.random.randn(*input_desc.shape).astype(
                input_desc.numpy_data_type())
            for input_desc in input_descriptions
        ])

    futures = []
    input_views = []

    for req_id in range(num_requests):
        print("Worker", worker_id, "Sending asynchronous request. Request id",
              req_id)
        input_view = model_runtime.InputMemoryView()
        for input_desc, input_tensor in zip(input_descriptions,
                                            input_requests[req_id], strict=True):
            input_view[input_desc.name] = input_tensor
        futures.append(model_runner.executeAsync(input_view))
        input_views.append(input_view)

    print("Worker", worker_id, "Processing outputs.")
    for req_id, future in enumerate(futures):
        print("Worker", worker_id, "Waiting for the result - request", req_id)
        future.wait()
        print("Worker", worker_id, "Result available - request", req_id)
        reference.check(future, input_views[req_id],
                        f"worker {worker_id} request {req_id}")


# -- ipuserve: checking the results ------------------------------------------------

def runWorker(model_runner, worker_id, reference):
    """workerMain, with whatever it raises recorded for main() to report."""
    try:
        workerMain(model_runner, worker_id, reference)
    except Exception as error:
        failures.append(f"worker {worker_id}: {error!r}")


class Reference:
    """The model's outputs computed with numpy alone (ipuserve's example models)."""

    def __init__(self, popef_paths):
        model = popef.load_model(popef_paths)
        self.name = model.metadata.modelName()
        self.tensor_data = popef.examples.tensor_arrays(model)
        self.known = self.name in popef.examples.EXAMPLES
        self.checked = 0
        self._lock = threading.Lock()
        if not self.known:
            print("Model", self.name, "is not an example model: results are not verified.")

    def check(self, future, inputs, what):
        if not self.known:
            return
        expected = popef.examples.reference(self.name, inputs, self.tensor_data)
        for name, want in expected.items():
            got = np.asarray(future[name])
            if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                failures.append(f"{what}: output {name} differs from the numpy reference")
        with self._lock:
            self.checked += 1


if __name__ == "__main__":
    sys.exit(main())
