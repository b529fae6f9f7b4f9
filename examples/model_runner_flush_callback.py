#!/usr/bin/env python3
# Copyright (c) 2022 Graphcore Ltd. All rights reserved.
"""
The example shows the flush callback (spec section 3.7) on a fused model: two
small models compiled into one graph, of which each run executes the one that
its `branch` input selects. It uses the model written by
`ipuserve model example branches branches.popef --batch-size 4`:

    branch == 0:  a_output = relu(a_input @ a_weight)       a_input [4, 4]
    branch == 1:  b_output = softmax(b_input @ b_weight)    b_input [4, 8]

With dynamic batching, a lone request of fewer samples than the compiled batch
leaves a batch partly filled; after `batch_size_timeout_ns` ModelRunner flushes:
it pads the batch with dummy samples and runs it. The real Model Runtime pads
*every* input and discards the rest of *every* output by default -- but the run
executes only one of the two models, so the other model's padding would stay
queued and be read, with its outputs thrown away, in place of that model's next
real request. ipuserve offers only the queues that hold a partial batch (the
executed model's), so the callback below is defensive rather than required here.

`flush_callback(tensor_id, inputs, outputs)` is called once per such timeout,
with the tensor the device was waiting for and views of the padding about to be
queued (`inputs`) and of the outputs whose rest will be discarded (`outputs`).
Here it keeps only the model being executed -- which the application must know
-- and sets its own padding values. The requests sent to the *other* model
after each flush then return the right results, which they would not otherwise.
"""

import argparse
import sys
from datetime import timedelta

import numpy as np

import ipuserve.runtime as model_runtime
from ipuserve.runtime import popef

# Which anchors each model of the `branches` graph uses, besides `branch`.
MODELS = {
    0: {"input": "a_input", "output": "a_output"},
    1: {"input": "b_input", "output": "b_output"},
}
SELECTOR = "branch"


class FusedModelFlush:
    """A flush callback that flushes only the model currently being executed."""

    def __init__(self):
        self.model = None  # set by the application before it sends a request
        self.calls = []

    def __call__(self, tensor_id, inputs, outputs):
        print(f"\tflush_callback: timed out waiting for tensor {tensor_id!r} while "
              f"assembling a batch for model {self.model}; padding offered: "
              + ", ".join(f"{name} {padding.shape}" for name, padding in inputs.items()))
        self.calls.append((tensor_id, {name: padding.shape for name, padding in inputs.items()}))
        for other, anchors in MODELS.items():
            if other != self.model:
                # Do not pad the other model's input or discard its output.
                inputs.pop(anchors["input"], None)
                outputs.pop(anchors["output"], None)
        # Custom padding values: the padded samples select the same model.
        inputs[SELECTOR][...] = self.model
        print("\tflush_callback: flushing only " + ", ".join([*inputs, *outputs]))


def main():
    parser = argparse.ArgumentParser("Model runner flush callback example.")
    parser.add_argument(
        "-p",
        "--popef",
        type=str,
        metavar='popef_file_path',
        help="A collection of PopEF files containing the model.",
        nargs='+',
        required=True)
    args = parser.parse_args()
    model = popef.load_model(args.popef)
    compiled_batch = model.metadata.batchSize()
    if compiled_batch < 2:
        sys.exit("FAILED: the model must be compiled for batches of 2 or more samples: "
                 "`ipuserve model example branches FILE --batch-size 4`")

    flush = FusedModelFlush()
    config = model_runtime.ModelRunnerConfig()
    config.validate_io_params = False  # requests carry one model's inputs only
    config.batching_dim = 0  # requests of any batch size
    config.is_batch_size_timeout_enabled = True
    config.batch_size_timeout_ns = timedelta(milliseconds=20)
    config.flush_on_waiting_outputs = True  # no idle flushes: see the docstring
    config.flush_callback = flush
    config.device_wait_config = model_runtime.DeviceWaitConfig(
        model_runtime.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
        timeout=timedelta(seconds=600),
        sleepTime=timedelta(seconds=1))

    print("Creating ModelRunner with", config)
    model_runner = model_runtime.ModelRunner(model, config=config)
    reference = Reference(model, {d.name: d for d in model_runner.getExecuteInputs()})

    # (model, samples): lone partial batches, each followed by a full batch
    # for the other model -- the one a default flush would have spoiled.
    plan = [(1, 1), (0, compiled_batch), (0, compiled_batch // 2), (1, compiled_batch)]
    for chosen, samples in plan:
        inputs = reference.random_inputs(chosen, samples)
        flush.model = chosen
        print(f"Sending a synchronous request with batch size {samples} to model {chosen} "
              f"(compiled batch: {compiled_batch})")
        outputs = model_runner.execute(inputs)
        reference.check(chosen, inputs, outputs)

    partial = [samples for _, samples in plan if samples % compiled_batch]
    if len(flush.calls) != len(partial):
        sys.exit(f"FAILED: flush_callback was called {len(flush.calls)} times, expected "
                 f"once per partial batch ({len(partial)})")
    counts = model_runner.getMonitoringStatisticsTotalCount({})
    padded = int(counts["padded_samples_monitoring_statistics_count"])
    print(f"flush_callback was called {len(flush.calls)} times; {padded} padded samples ran.")
    if padded != sum(compiled_batch - samples for samples in partial):
        sys.exit(f"FAILED: {padded} padded samples, expected the rest of each partial batch")

    print("Success: exiting")
    return 0


# -- ipuserve: inputs and checking the results ------------------------------------

class Reference:
    """Random requests for one model, and what it must return (numpy alone)."""

    def __init__(self, model, input_descriptions):
        self.tensor_data = popef.examples.tensor_arrays(model)
        self.descriptions = input_descriptions

    def random_inputs(self, chosen, samples):
        name = MODELS[chosen]["input"]
        desc = self.descriptions[name]
        inputs = model_runtime.InputMemoryView()
        inputs[SELECTOR] = np.full(samples, chosen, np.int32)
        inputs[name] = np.random.randn(samples, *desc.shape[1:]).astype(
            desc.numpy_data_type())
        return inputs

    def check(self, chosen, inputs, outputs):
        """Exit with status 1 unless the chosen model's output came back right."""
        expected = popef.examples.reference("branches", inputs, self.tensor_data)
        for name, want in expected.items():
            got = np.asarray(outputs[name])
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                sys.exit(f"FAILED: model {chosen}: output {name} differs from the numpy "
                         f"reference:\n{got}\nexpected:\n{want}")
        print(f"\tVerified {', '.join(expected)} of shape {want.shape} against the numpy "
              "reference.")


if __name__ == "__main__":
    sys.exit(main())
