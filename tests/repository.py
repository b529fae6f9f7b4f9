"""What the tests of models at run time share: a repository written by the real CLI
(``ipuserve model example --repository``), a repository worker's command line, and the
repository's ``mlp`` versions with their numpy references (their weights differ by
seed, so a result tells which version computed it)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ipuserve.runtime.popef import examples
from ipuserve.runtime.popef.reader import load_model

Array = np.ndarray[Any, Any]
#: a small mlp: 16 inputs, one hidden layer of 32 (fast to build and to run)
SMALL_MLP = ("--input-size", "16", "--hidden-size", "32", "--layers", "1")


def write_version(repo: Path, name: str, *options: str) -> str:
    """``ipuserve model example NAME --repository REPO OPTIONS...`` (a real process)."""
    argv = [sys.executable, "-m", "ipuserve", "model", "example", name, "--repository", str(repo)]
    done = subprocess.run([*argv, *options], check=True, capture_output=True, text=True)
    return done.stdout


def repository_worker_argv(
    brokers: Sequence[str], repo: Path, worker_id: str, *args: str, ipus: int = 4
) -> list[str]:
    """A real ``ipuserve worker --repository`` of every broker backend in ``brokers``."""
    endpoints = [part for backend in brokers for part in ("--broker", backend)]
    return [
        *(sys.executable, "-m", "ipuserve", "--log-level", "INFO", "worker", *endpoints),
        *("--repository", str(repo), "--ipus", str(ipus), "--worker-id", worker_id),
        *("--heartbeat-ms", "50", *args),
    ]


class MlpVersions:
    """The repository's ``mlp`` versions and their numpy references."""

    def __init__(self, repo: Path, versions: Sequence[str] = ("1", "2")) -> None:
        self.weights = {
            v: examples.tensor_arrays(load_model([str(repo / "mlp" / v / "mlp.popef")]))
            for v in versions
        }

    def reference(self, version: str, inputs: Mapping[str, Array]) -> dict[str, Array]:
        return examples.reference("mlp", dict(inputs), self.weights[version])

    def matches(
        self, version: str | None, inputs: Mapping[str, Array], got: Mapping[str, Any]
    ) -> bool:
        """Whether ``got`` is what ``version`` (as a reply names it) answers."""
        if version not in self.weights:
            return False
        want = self.reference(version, inputs)
        return all(np.allclose(got[k], want[k], rtol=1e-4, atol=1e-5) for k in want)

    def which(self, inputs: Mapping[str, Array], got: Mapping[str, Any]) -> str:
        """The version whose numpy reference ``got`` matches (fails if none)."""
        for version in self.weights:
            if self.matches(version, inputs, got):
                return version
        raise AssertionError(f"the outputs match no version's reference: {dict(got)}")
