#!/usr/bin/env python3
# Copyright (c) 2022 Graphcore Ltd. All rights reserved.
"""
The example shows conditional execution (spec section 3.5): one compiled graph
holding two models, of which each run executes the one an input selects.

It uses the model written by `ipuserve model example branches`:

    branch == 0:  a_output = relu(a_input @ a_weight)       a_input [B, 4]
    branch == 1:  b_output = softmax(b_input @ b_weight)    b_input [B, 8]

where `branch` (int32 [B]) is a stream input whose first sample picks the
model, and the weights are tensors saved as PopEF tensor data.

Two things make this work:
  * validate_io_params is disabled, so a request may carry only the inputs of
    the model it wants to run (with validation on, every execute input would
    be required and the request would also wait for the other model's output);
  * the application knows which anchors belong to which model: the PopEF file
    lists the anchors but not that grouping (`ipuserve model inspect FILE`,
    the spec's popef_dump, shows them).

A request carrying the inputs of a different model than the one its selector
picks is never completed: the device waits for inputs that do not come.
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


def main():
    parser = argparse.ArgumentParser("Model runner conditional execution example.")
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
    check_anchors(model)

    config = model_runtime.ModelRunnerConfig()
    # Requests carry the inputs of one model only.
    config.validate_io_params = False
    # Flush (pad with dummy data) only while a request waits for outputs. An
    # idle flush would pad the queues of *both* models, while the next run
    # reads only one model's inputs: the other's padding would stay behind.
    config.flush_on_waiting_outputs = True
    config.device_wait_config = model_runtime.DeviceWaitConfig(
        model_runtime.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
        timeout=timedelta(seconds=600),
        sleepTime=timedelta(seconds=1))

    print("Creating ModelRunner with", config)
    model_runner = model_runtime.ModelRunner(model, config=config)

    descriptions = {desc.name: desc for desc in model_runner.getExecuteInputs()}
    print("Execute inputs (of both models):", ", ".join(descriptions))
    print("Execute outputs (of both models):",
          ", ".join(desc.name for desc in model_runner.getExecuteOutputs()))

    requests = []
    for request_id in range(6):
        chosen = request_id % 2
        input_view = model_runtime.InputMemoryView()
        input_view[SELECTOR] = random_tensor(descriptions[SELECTOR], chosen)
        input_name = MODELS[chosen]["input"]
        input_view[input_name] = random_tensor(descriptions[input_name])
        print(f"Sending asynchronous request {request_id} to model {chosen} "
              f"with inputs: {', '.join(input_view)}")
        requests.append((chosen, input_view, model_runner.executeAsync(input_view)))

    expected_from = Reference(model)
    for request_id, (chosen, input_view, future) in enumerate(requests):
        future.wait()
        print(f"Request {request_id} (model {chosen}) returned: {', '.join(future)}")
        expected_from.check(chosen, input_view, future)

    print("Sending a synchronous request to model 1 with a user-allocated output:"
          " the output view names the outputs to wait for.")
    input_view = model_runtime.InputMemoryView()
    input_view[SELECTOR] = random_tensor(descriptions[SELECTOR], 1)
    input_view["b_input"] = random_tensor(descriptions["b_input"])
    output_desc = {desc.name: desc for desc in model_runner.getExecuteOutputs()}["b_output"]
    output_view = model_runtime.OutputMemoryView()
    output_view["b_output"] = np.zeros(output_desc.shape, output_desc.numpy_data_type())
    model_runner.execute(input_view, output_view)
    print("\tname: b_output shape:", output_view["b_output"].shape, "\n",
          output_view["b_output"])
    expected_from.check(1, input_view, output_view)

    print("Success: exiting")
    return 0


def random_tensor(desc, value=None):
    """A tensor shaped like one compiled batch: random data, or ``value`` everywhere."""
    if value is not None:
        return np.full(desc.shape, value, dtype=desc.numpy_data_type())
    return np.random.randn(*desc.shape).astype(desc.numpy_data_type())


def check_anchors(model):
    names = {anchor.name() for anchor in model.metadata.anchors()}
    wanted = {SELECTOR} | {name for io in MODELS.values() for name in io.values()}
    if not wanted <= names:
        sys.exit(f"FAILED: the model has no anchor(s) {sorted(wanted - names)}; write it "
                 "with `ipuserve model example branches FILE`")


class Reference:
    """What each model must return, computed with numpy alone."""

    def __init__(self, model):
        self.tensor_data = popef.examples.tensor_arrays(model)

    def check(self, chosen, inputs, outputs):
        """Exit with status 1 unless exactly the chosen model's output came back right."""
        expected = popef.examples.reference("branches", inputs, self.tensor_data)
        if set(outputs) != set(expected):
            sys.exit(f"FAILED: model {chosen}: got outputs {sorted(outputs)}, "
                     f"expected {sorted(expected)}")
        for name, want in expected.items():
            got = np.asarray(outputs[name])
            if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                sys.exit(f"FAILED: model {chosen}: output {name} differs from the numpy "
                         f"reference:\n{got}\nexpected:\n{want}")
        print("\tVerified", ", ".join(expected), "against the numpy reference.")


if __name__ == "__main__":
    sys.exit(main())
