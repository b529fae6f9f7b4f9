#!/usr/bin/env python3
# Copyright (c) 2022 Graphcore Ltd. All rights reserved.
"""
The example shows dynamic batch sizing (spec section 3.6): requests of any
batch size, which ModelRunner packs into the batch the model was compiled for.

Without `batching_dim`, every request must hold a whole multiple of the
compiled batch. With `batching_dim` set to the dimension that holds the batch,
a request may hold any number of samples: consecutive requests share compiled
batches, and a request may be split across two of them.

When no more samples come, a partly filled batch would wait for ever; with
`is_batch_size_timeout_enabled`, it waits at most `batch_size_timeout_ns`
(counted from the arrival of its first sample) and is then padded with dummy
samples and run. Padded samples' outputs are discarded.

It expects e.g. `ipuserve model example simple simple.popef --batch-size 8`,
or, with `--batching-dim 1`, a model whose I/O holds the batch in dimension 1:
`ipuserve model example simple simple.popef --batch-size 8 --batch-dim 1`.
"""

import argparse
import sys
from datetime import timedelta

import numpy as np

import ipuserve.runtime as model_runtime
from ipuserve.runtime import popef

# Batch sizes of the requests sent one after the other: 23 samples in all.
REQUEST_BATCH_SIZES = [1, 2, 3, 5, 7, 1, 4]


def main():
    parser = argparse.ArgumentParser("Model runner dynamic batch size example.")
    parser.add_argument(
        "-p",
        "--popef",
        type=str,
        metavar='popef_file_path',
        help="A collection of PopEF files containing the model.",
        nargs='+',
        required=True)
    parser.add_argument(
        "--batching-dim",
        type=int,
        default=0,
        help="The dimension of the input and output tensors holding the batch.")
    args = parser.parse_args()

    config = model_runtime.ModelRunnerConfig()
    config.batching_dim = args.batching_dim
    # A partly filled batch waits at most 20 ms for more samples, then is padded.
    config.is_batch_size_timeout_enabled = True
    config.batch_size_timeout_ns = timedelta(milliseconds=20)
    # Never pad while no request waits: every run then carries real samples.
    config.flush_on_waiting_outputs = True
    config.device_wait_config = model_runtime.DeviceWaitConfig(
        model_runtime.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
        timeout=timedelta(seconds=600),
        sleepTime=timedelta(seconds=1))

    print("Creating ModelRunner with", config)
    model_runner = model_runtime.ModelRunner(model_runtime.PopefPaths(args.popef),
                                             config=config)
    input_descriptions = model_runner.getExecuteInputs()
    compiled_batch = input_descriptions[0].shape[args.batching_dim]
    print(f"The model was compiled for batches of {compiled_batch} "
          f"(dimension {args.batching_dim} of its inputs):")
    for desc in input_descriptions:
        print("\tname:", desc.name, "shape:", desc.shape, "dtype:", desc.numpy_data_type())

    requests = []
    for batch_size in REQUEST_BATCH_SIZES:
        input_view = model_runtime.InputMemoryView()
        for desc in input_descriptions:
            shape = list(desc.shape)
            shape[args.batching_dim] = batch_size
            input_view[desc.name] = np.random.randn(*shape).astype(desc.numpy_data_type())
        print(f"Sending asynchronous request with batch size {batch_size}")
        requests.append((input_view, model_runner.executeAsync(input_view)))

    reference = Reference(args.popef, args.batching_dim)
    for input_view, future in requests:
        future.wait()
        for name in future:
            print(f"\tReceived output {name} of shape {future[name].shape}")
        reference.check(input_view, future)

    # Padding fills the last batch up to the compiled batch size, so real and
    # padded samples together make whole batches.
    samples = sum(REQUEST_BATCH_SIZES)
    counts = model_runner.getMonitoringStatisticsTotalCount({})
    padded = int(counts["padded_samples_monitoring_statistics_count"])
    flushed = int(counts["flushed_batches_monitoring_statistics_count"])
    print(f"{len(requests)} requests with {samples} samples and {padded} padded samples "
          f"made {(samples + padded) / compiled_batch:g} batches of {compiled_batch}; "
          f"{flushed} of them padded after the batch size timeout.")
    if (samples + padded) % compiled_batch or (samples % compiled_batch and not flushed):
        sys.exit(f"FAILED: {samples} samples plus {padded} padded ones do not make whole "
                 f"batches of {compiled_batch}")

    print("Success: exiting")
    return 0


# -- ipuserve: checking the results ------------------------------------------------

class Reference:
    """The model's outputs computed with numpy alone (ipuserve's example models)."""

    def __init__(self, popef_paths, batching_dim):
        model = popef.load_model(popef_paths)
        self.name = model.metadata.modelName()
        self.tensor_data = popef.examples.tensor_arrays(model)
        # Only `simple` computes differently when its batch is in dimension 1.
        self.options = {"batch_dim": batching_dim} if self.name == "simple" else {}
        if self.name not in popef.examples.EXAMPLES:
            print("Model", self.name, "is not an example model: results are not verified.")

    def check(self, inputs, outputs):
        """Exit with status 1 unless ``outputs`` match the numpy reference."""
        if self.name not in popef.examples.EXAMPLES:
            return
        expected = popef.examples.reference(self.name, inputs, self.tensor_data,
                                            **self.options)
        for name, want in expected.items():
            got = np.asarray(outputs[name])
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                sys.exit(f"FAILED: output {name} differs from the numpy reference:\n"
                         f"{got}\nexpected:\n{want}")
        print("\tVerified against the numpy reference.")


if __name__ == "__main__":
    sys.exit(main())
