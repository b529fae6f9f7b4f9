#!/usr/bin/env python3
# Copyright (c) 2022 Graphcore Ltd. All rights reserved.
# ipuserve: spec listing 3.4 with only its imports changed, plus a check of each
# replica's result against a plain-numpy computation of the model.
"""
The example shows loading a model from PopEF files, creating 2 model replicas
and sending inference requests to each of them.

Each replica runs on its own (simulated) IPU, so the host needs two free IPUs.
Both replicas get the same input and must return the same output: the one
``popef.examples.reference`` computes with numpy alone.
"""

import argparse
import sys
from datetime import timedelta

import numpy as np

import ipuserve.runtime as model_runtime
from ipuserve.runtime import popef


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

    num_replicas = 2
    # Create model runner
    config = model_runtime.ModelRunnerConfig()
    config.replication_factor = num_replicas
    config.device_wait_config = model_runtime.DeviceWaitConfig(
        model_runtime.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
        timeout=timedelta(seconds=600),
        sleepTime=timedelta(seconds=1))

    print("Creating ModelRunner with", config)
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths(args.popef),
                                       config=config)

    print("Preparing input tensors:")
    input_descriptions = runner.getExecuteInputs()
    input_tensors = [
        np.random.randn(*input_desc.shape).astype(input_desc.numpy_data_type())
        for input_desc in input_descriptions
    ]
    input_view = model_runtime.InputMemoryView()

    for input_desc, input_tensor in zip(input_descriptions, input_tensors, strict=True):
        print("\tname:", input_desc.name, "shape:", input_tensor.shape,
              "dtype:", input_tensor.dtype)
        input_view[input_desc.name] = input_tensor

    # ipuserve: what every replica must return.
    expected = expected_outputs(args.popef, input_view)

    for replica_id in range(num_replicas):
        print("Sending single synchronous request with empty data - replica",
              replica_id, ".")
        result = runner.execute(input_view, replica_id=replica_id)
        output_descriptions = runner.getExecuteOutputs()

        print("Processing output tensors - replica", replica_id, ":")
        outputs = {}
        for output_desc in output_descriptions:
            output_tensor = np.frombuffer(
                result[output_desc.name],
                dtype=output_desc.numpy_data_type()).reshape(output_desc.shape)
            print("\tname:", output_desc.name, "shape:", output_tensor.shape,
                  "dtype:", output_tensor.dtype, "\n", output_tensor)
            outputs[output_desc.name] = output_tensor
        check(outputs, expected, replica_id)

    print("Success: exiting")
    return 0


# -- ipuserve: checking the results ------------------------------------------------

def expected_outputs(popef_paths, inputs):
    """The model's outputs for ``inputs`` computed with numpy alone, or None when
    the model is not one of ipuserve's example models."""
    model = popef.load_model(popef_paths)
    name = model.metadata.modelName()
    if name not in popef.examples.EXAMPLES:
        print("Model", name, "is not an example model: results are not verified.")
        return None
    return popef.examples.reference(name, inputs,
                                    popef.examples.tensor_arrays(model))


def check(outputs, expected, replica_id):
    """Exit with status 1 unless ``outputs`` match the numpy reference."""
    if expected is None:
        return
    for name, want in expected.items():
        got = np.asarray(outputs[name])
        if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
            sys.exit(f"FAILED: replica {replica_id}: output {name} differs from the "
                     f"numpy reference:\n{got}\nexpected:\n{want}")
    print("Verified against the numpy reference - replica", replica_id)


if __name__ == "__main__":
    sys.exit(main())
