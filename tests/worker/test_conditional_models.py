"""A worker refuses a model with conditional execution (spec 3.5) at start: each of
its requests streams one branch's anchors only, so a request served with every
input and waiting for every output hung, and the unread inputs of the other branch
shifted every later request's until the worker's credit was used up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ipuserve.errors import ConfigError
from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.builder import GraphBuilder
from ipuserve.worker.model_checks import check_unconditional
from tests.helpers import write_example


def test_a_model_that_streams_anchors_in_one_branch_only_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        check_unconditional(examples.branches(batch_size=1).build())
    message = str(caught.value)
    assert "model 'branches' runs one of several branches per request" in message
    assert "a_input, a_output, b_input, b_output are streamed by a branch only" in message
    assert "validate_io_params=False" in message


@pytest.mark.parametrize(
    "builder",
    [
        examples.simple(batch_size=2),
        examples.noop(batch_size=1, elements=4),
        examples.mlp(batch_size=2, input_size=3, hidden_size=5, outputs=7),
    ],
)
def test_models_without_branches_pass(builder: GraphBuilder) -> None:
    check_unconditional(builder.build())


def test_a_switch_that_streams_nothing_of_its_own_passes() -> None:
    """Every run streams the same anchors: the switch only picks the computation."""
    g = GraphBuilder("pick", batch_size=1)
    selector, x = g.input("branch", (1,), "int32"), g.input("x", (1, 4))
    with g.switch(selector) as switch:
        with switch.branch():
            g.relu(x)
        with switch.branch():
            g.identity(x)
    g.output("y", x)
    check_unconditional(g.build())


def test_the_worker_command_says_why_and_exits_before_joining(tmp_path: Path) -> None:
    path = write_example(tmp_path / "branches.popef", "branches")
    argv = [sys.executable, "-m", "ipuserve", "worker", "--broker", "tcp://127.0.0.1:1"]
    done = subprocess.run(
        [*argv, "--model", path], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"Error: cannot serve {path}: model 'branches' runs one of several branches")
    )
