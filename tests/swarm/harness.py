"""Drive compose.yaml on Docker Swarm from a test: the swarm, the stack, its tasks, probes.

The swarm is the engine's own: joined if the engine is a single-node swarm manager
already, else made with ``docker swarm init --advertise-addr 127.0.0.1`` and left
(``--force``) at the end, so the machine is left as found. The stack is compose.yaml
through the same filter a person uses (``SWARM_FILTER``: compose.yaml's header and
docs/deploy.md show it) and ``docker stack deploy -c -``: the CLI, as typed. Everything
else goes through the Docker SDK: services, tasks, containers, exec, kill. Nothing
waits a fixed time: every wait polls a condition until a deadline.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import numpy as np
import numpy.typing as npt
import requests
from docker.models.containers import Container

from tests.compose.harness import COMPOSE_FILE, ROOT, poll

REQUIRED_ENV = "IPUSERVE_SWARM_REQUIRED"
"""``1``: a missing engine or swarm fails the tests instead of skipping them (.ci/run)."""
STACK_ENV = "IPUSERVE_SWARM_STACK"
"""Stack name; default: a fresh unique name per test session."""
BROKERS_ENV = "IPUSERVE_SWARM_BROKERS"
"""Broker replicas the tests deploy (default 2; 1 runs everything on one broker)."""

SWARM_FILTER = [
    "sed",
    "-e",
    "/# >>> compose only/,/# <<< compose only/d",
    "-e",
    r"s/^\( *\)#swarm /\1/",
]
"""compose.yaml -> what `docker stack deploy` reads (compose.yaml's header explains)."""
STACK_LABEL = "com.docker.stack.namespace"
GWBRIDGE = "docker_gwbridge"
"""The bridge `docker swarm init` adds for containers on overlays to reach outside."""
PROBE = Path(__file__).with_name("probe.py")
ROLES = ("broker", "worker", "client", "admin", "gateway")

Array = npt.NDArray[Any]


class SwarmUnavailable(Exception):
    """The engine cannot run the stack here (a worker node, a multi-node swarm, ...)."""


@dataclass
class Swarm:
    """The engine's swarm, and whether this session made it (and so must leave it)."""

    engine: docker.DockerClient
    created: bool
    made_gwbridge: bool = False
    """Whether `swarm init` made the docker_gwbridge network (`leave` does not remove it)."""

    @classmethod
    def join_or_init(cls, engine: docker.DockerClient) -> Swarm:
        info: dict[str, Any] = engine.info().get("Swarm") or {}
        state = info.get("LocalNodeState", "inactive")
        if state == "active":
            if not info.get("ControlAvailable"):
                raise SwarmUnavailable(
                    "the engine is a swarm worker node: stacks deploy from a manager"
                )
            if int(info.get("Nodes") or 0) != 1:
                raise SwarmUnavailable(
                    f"the engine is a manager of a {info.get('Nodes')}-node swarm: the test "
                    "stack's image is on this node only; run it on an engine not in a swarm "
                    "(it makes a single-node one and leaves it after)"
                )
            return cls(engine, created=False)
        if state != "inactive":
            raise SwarmUnavailable(f"the engine's swarm state is {state!r}")
        had_gwbridge = bool(engine.networks.list(names=[GWBRIDGE]))
        try:
            engine.swarm.init(advertise_addr="127.0.0.1", listen_addr="127.0.0.1:2377")
        except docker.errors.APIError as exc:
            raise SwarmUnavailable(f"`docker swarm init` failed: {exc.explanation}") from None
        return cls(engine, created=True, made_gwbridge=not had_gwbridge)

    def leave(self) -> None:
        """Leave the swarm if this session made it, and remove what `init` added."""
        if not self.created:
            return
        self.engine.swarm.leave(force=True)
        if self.made_gwbridge:
            for network in self.engine.networks.list(names=[GWBRIDGE]):
                network.remove()


@dataclass(frozen=True)
class Task:
    """One running task of a service: its container and its address on the overlay."""

    id: str
    slot: int
    container_id: str
    address: str
    state: str

    def endpoint(self, port: int) -> str:
        return f"tcp://{self.address}:{port}"


def make_keys(folder: Path) -> Path:
    """The key folder a stack reads its secrets from, made as docs/deploy.md says:
    ``ipuserve keys generate ROLE --dir FOLDER/ROLE`` for every role."""
    for role in ROLES:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ipuserve",
                "keys",
                "generate",
                role,
                "--dir",
                str(folder / role),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
    return folder


def stack_file() -> str:
    """compose.yaml as `docker stack deploy` reads it (SWARM_FILTER)."""
    result = subprocess.run(
        [*SWARM_FILTER, str(COMPOSE_FILE)], capture_output=True, text=True, check=True
    )
    return result.stdout


@dataclass
class Stack:
    """One deployed copy of compose.yaml on the swarm."""

    name: str
    engine: docker.DockerClient
    keys: Path
    settings: dict[str, str]
    """Variables compose.yaml interpolates (IPUSERVE_IMAGE, IPUSERVE_BROKERS, ...)."""
    _env: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # As for compose: the host's IPUSERVE_* must not reach the stack's interpolation.
        base = {k: v for k, v in os.environ.items() if not k.startswith("IPUSERVE_")}
        self._env = {**base, "IPUSERVE_STACK_KEYS": str(self.keys), **self.settings}

    @property
    def network(self) -> str:
        return f"{self.name}_fabric"

    def service(self, name: str) -> str:
        return f"{self.name}_{name}"

    # -- the stack ----------------------------------------------------------------

    def deploy(self) -> str:
        result = subprocess.run(
            ["docker", "stack", "deploy", "--resolve-image", "never", "-c", "-", self.name],
            input=stack_file(),
            env=self._env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"docker stack deploy failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout + result.stderr

    def remove(self, timeout: float = 120) -> None:
        """`docker stack rm`, then wait until its services, containers, networks and
        secrets are gone (the removal is asynchronous)."""
        subprocess.run(
            ["docker", "stack", "rm", self.name], capture_output=True, timeout=60, check=False
        )
        poll(
            lambda: True if not self.leftovers() else None,
            timeout=timeout,
            interval=0.5,
            what=f"stack {self.name} to be gone",
            diagnose=lambda: repr(self.leftovers()),
        )
        # `stack rm` keeps volumes (the model repository's): the next stack starts fresh
        labels = {"label": f"{STACK_LABEL}={self.name}"}
        for volume in self.engine.volumes.list(filters=labels):
            try:
                volume.remove(force=True)
            except docker.errors.APIError:
                pass  # a task container not yet removed still holds it: left for docker

    def leftovers(self) -> list[str]:
        """What of the stack still exists: services, containers, networks, secrets."""
        labels = {"label": f"{STACK_LABEL}={self.name}"}
        found = [f"service {s.name}" for s in self.engine.services.list(filters=labels)]
        found += [f"container {name}" for name in self._container_names(labels)]
        found += [f"network {n.name}" for n in self.engine.networks.list(filters=labels)]
        found += [f"secret {s.name}" for s in self.engine.secrets.list(filters=labels)]
        return found

    # -- services and tasks ---------------------------------------------------------

    def tasks(self, service: str) -> list[Task]:
        """The service's tasks that run now, with their overlay addresses, by slot."""
        found = []
        for task in self.engine.services.get(self.service(service)).tasks(
            filters={"desired-state": "running"}
        ):
            status: dict[str, Any] = task.get("Status") or {}
            container = (status.get("ContainerStatus") or {}).get("ContainerID")
            address = ""
            for attachment in task.get("NetworksAttachments") or []:
                if attachment["Network"]["Spec"]["Name"] == self.network:
                    address = attachment["Addresses"][0].split("/")[0]
            if status.get("State") == "running" and container and address:
                found.append(
                    Task(task["ID"], int(task.get("Slot") or 0), container, address, "running")
                )
        return sorted(found, key=lambda t: (t.slot, t.id))

    def container(self, task: Task) -> Container:
        return self.engine.containers.get(task.container_id)

    def health(self, task: Task) -> str:
        try:
            state: dict[str, Any] = self.container(task).attrs.get("State") or {}
        except docker.errors.NotFound:
            return "gone"
        return str((state.get("Health") or {}).get("Status") or state.get("Status"))

    def wait_healthy(self, service: str, count: int, timeout: float = 180) -> list[Task]:
        """Wait until exactly ``count`` tasks of ``service`` run and are healthy."""

        def healthy() -> list[Task] | None:
            tasks = self.tasks(service)
            ok = len(tasks) == count and all(self.health(t) == "healthy" for t in tasks)
            return tasks if ok else None

        return poll(
            healthy,
            timeout=timeout,
            interval=1.0,
            what=f"{count} healthy {service} tasks",
            diagnose=self.describe,
        )

    def scale(self, service: str, replicas: int) -> None:
        """`docker service scale STACK_SERVICE=N` (the CLI: the SDK's scale re-sends the
        whole spec, which Swarm may take for a change and roll every task)."""
        subprocess.run(
            ["docker", "service", "scale", "--detach", f"{self.service(service)}={replicas}"],
            capture_output=True,
            timeout=60,
            check=True,
        )

    def kill(self, task: Task) -> None:
        """SIGKILL the task's container: no goodbye to anyone."""
        self.container(task).kill()

    def hostname(self, task: Task) -> str:
        """The task container's hostname: the prefix of a worker's id (hostname:pid)."""
        return str(self.container(task).attrs["Config"]["Hostname"])

    # -- inside a broker task ---------------------------------------------------------

    def broker_workers(self, task: Task) -> dict[str, list[str]]:
        """Model -> worker ids that broker task lists (its own `ipuserve models`, the
        health check's admin key and the broker's public key already in its env)."""
        argv = ["ipuserve", "models", "--broker", "tcp://127.0.0.1:5555", "--json"]
        code, output = self.container(task).exec_run(argv, demux=False)
        if code != 0:
            return {}
        listing: list[dict[str, Any]] = json.loads(output)
        return {
            str(m["spec"]["name"]): sorted(str(w["worker_id"]) for w in m["workers"])
            for m in listing
        }

    def file_modes(self, task: Task, *paths: str) -> list[str]:
        """``"UID MODE"`` (octal) of files inside the task's container."""
        code, output = self.container(task).exec_run(["stat", "-c", "%u %a", *paths])
        assert code == 0, output
        return output.decode().split("\n")[: len(paths)]

    def broker_metric(self, task: Task, family: str) -> float:
        """One Prometheus family's total as that broker task serves it on :9100."""
        script = (
            "import urllib.request;"
            "print(urllib.request.urlopen('http://127.0.0.1:9100/metrics', timeout=5)"
            ".read().decode())"
        )
        code, output = self.container(task).exec_run(["python", "-c", script])
        if code != 0:
            return 0.0
        total = 0.0
        for line in output.decode().splitlines():
            if line.split("{", 1)[0].split(" ", 1)[0] == family:
                total += float(line.rsplit(" ", 1)[1])
        return total

    # -- probes: clients in containers on the overlay ---------------------------------------

    def probe(self, *args: str) -> Container:
        """Start tests/swarm/probe.py in a container on the stack's network (detached)."""
        keys = {
            "IPUSERVE_PROBE_CLIENT_SECRET": (self.keys / "client/client.key_secret").read_text(),
            "IPUSERVE_PROBE_BROKER_PUBLIC": (self.keys / "broker/broker.key").read_text(),
            "IPUSERVE_LOG_LEVEL": "WARNING",
        }
        container: Container = self.engine.containers.run(
            self.settings["IPUSERVE_IMAGE"],
            entrypoint=["python", "-c", PROBE.read_text()],
            command=list(args),
            environment=keys,
            network=self.network,
            labels={"org.ipuserve.test": self.name},
            detach=True,
        )
        return container

    def probe_result(self, container: Container, timeout: float = 180) -> dict[str, Any]:
        """Wait for a probe to exit 0 and return its report (its last line); removes it."""
        try:
            status = container.wait(timeout=timeout)
            output = container.logs().decode(errors="replace")
        finally:
            container.remove(force=True)
        if status.get("StatusCode") != 0:
            raise AssertionError(f"probe failed ({status}):\n{output[-4000:]}")
        report: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
        return report

    def run_probe(self, *args: str, timeout: float = 180) -> dict[str, Any]:
        return self.probe_result(self.probe(*args), timeout=timeout)

    def remove_probes(self) -> None:
        for name in self._container_names({"label": f"org.ipuserve.test={self.name}"}):
            try:
                self.engine.containers.get(name).remove(force=True)
            except docker.errors.NotFound:
                pass  # went away meanwhile

    def _container_names(self, filters: dict[str, str]) -> list[str]:
        """Names of the containers that match, without inspecting each (``sparse``: a
        full listing fails when one of them is removed between the list and its
        inspection, as Swarm removes old tasks' containers at any time)."""
        found = self.engine.containers.list(all=True, sparse=True, filters=filters)
        return [str((c.attrs.get("Names") or [c.id])[0]).lstrip("/") for c in found]

    # -- diagnostics -----------------------------------------------------------------

    def describe(self) -> str:
        """The stack's tasks and recent logs, for a failure message. Never raises."""
        lines = [f"--- stack {self.name}"]
        try:
            for service in self.engine.services.list(
                filters={"label": f"{STACK_LABEL}={self.name}"}
            ):
                for task in service.tasks():
                    status = task.get("Status") or {}
                    lines.append(
                        f"    {service.name}.{task.get('Slot')} {task['ID'][:12]}: "
                        f"{status.get('State')} (desired {task.get('DesiredState')}) "
                        f"{status.get('Err', '')}"
                    )
            for name in self._container_names({"label": f"{STACK_LABEL}={self.name}"}):
                try:
                    container = self.engine.containers.get(name)
                    text = container.logs(tail=30).decode(errors="replace")
                except docker.errors.NotFound:
                    continue  # removed meanwhile
                lines.append(f"--- logs of {name} ({container.status})\n{text}")
        except (docker.errors.DockerException, requests.RequestException) as exc:
            lines.append(f"(describe failed: {exc})")
        return "\n".join(lines)


def unpack(report: Mapping[str, Any]) -> dict[str, Array]:
    """A probe's outputs: ``index`` and each output's arrays, stacked in that order."""
    with np.load(io.BytesIO(base64.b64decode(report["outputs"]))) as saved:
        return {name: saved[name] for name in saved.files}


def probe_inputs(report: Mapping[str, Any], index: int) -> dict[str, Array]:
    """The inputs probe.py made for request ``index`` (its ``make_inputs``), from the
    model spec and seed its report gives."""
    spec = report["spec"]
    rng = np.random.default_rng([int(report["seed"]), index])
    inputs = {}
    for tensor in spec["inputs"]:
        shape = list(tensor["shape"])
        if spec["batching_dim"] is not None:
            shape[spec["batching_dim"]] = 1
        inputs[tensor["name"]] = rng.standard_normal(shape).astype(tensor["dtype"])
    return inputs
