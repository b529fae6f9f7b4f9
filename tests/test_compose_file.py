"""compose.yaml passes every setting of the broker and worker commands through from
the environment, as docs/deploy.md promises, and its Swarm filter gives a file Swarm
can read (checked without Docker: tests/compose and tests/swarm run the file for real)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest

from ipuserve.face.cli import main
from tests.swarm.harness import SWARM_FILTER

ROOT = Path(__file__).resolve().parent.parent
#: Options compose.yaml fixes on purpose (docs/deploy.md, "Fixed in compose.yaml"),
#: or that only make sense outside a container.
#: compose runs with keys, so --insecure (keyless only) would be a usage error there.
FIXED = {
    "broker": {"frontend", "backend", "metrics_port", "metrics_host", "insecure"},
    # the repository workers' --repository is the volume's mount point
    "worker": {"models", "worker_id", "metrics_port", "metrics_host", "repository"},
    # the doors' addresses and --insecure (the published ports decide exposure); TLS
    # needs files mounted: an override's (docs/deploy.md). Tokens are passed through:
    # the `keys` job makes their files (compose.yaml's header)
    "gateway": {"http", "grpc", "insecure", "tls_cert", "tls_key"},
}


@pytest.mark.parametrize("command", ["broker", "worker", "gateway"])
def test_compose_passes_every_option_through_under_its_cli_name(command: str) -> None:
    text = (ROOT / "compose.yaml").read_text()
    passed = set(re.findall(r"^\s+(IPUSERVE_\w+):", text, re.MULTILINE))
    options = {  # a hidden option is no setting (gateway --supervised: its supervisor's)
        p.name
        for p in main.commands[command].params
        if p.name and isinstance(p, click.Option) and not p.hidden
    }
    passed_through = options - FIXED[command]
    expected = {f"IPUSERVE_{command.upper()}_{name.upper()}" for name in passed_through}
    assert expected - passed == set()
    documented = (ROOT / "docs" / "deploy.md").read_text()
    assert {v for v in expected if f"`{v}`" not in documented} == set()


def swarm_view() -> str:
    return subprocess.run(
        [*SWARM_FILTER, str(ROOT / "compose.yaml")], capture_output=True, text=True, check=True
    ).stdout


def top_level_keys(text: str) -> list[str]:
    return re.findall(r"^([a-z][\w-]*):", text, re.MULTILINE)


def services(text: str) -> list[str]:
    body = text[text.index("\nservices:\n") :]
    return re.findall(r"^  ([a-z][\w-]*):$", body, re.MULTILINE)


def test_the_swarm_view_drops_what_stack_deploy_cannot_read() -> None:
    """`docker stack deploy` reads the v3 format: a version, depends_on lists only, no
    profiles. The filter leaves it the broker and workers, the network, the secrets and
    the model repository's volume, and drops the Compose-only job, keys volume and ports."""
    compose = (ROOT / "compose.yaml").read_text()
    swarm = swarm_view()
    assert top_level_keys(compose) == [
        "x-ipuserve",
        "networks",
        "x-restart-policy",
        "volumes",
        "services",
    ]
    assert top_level_keys(swarm) == [
        "version",
        "x-ipuserve",
        "networks",
        "x-restart-policy",
        "volumes",
        "x-secret-key",
        "secrets",
        "services",
    ]
    assert services(compose) == [
        "keys",
        "broker",
        "worker",
        "repository-worker",
        "gateway",
        "client",
    ]
    assert services(swarm) == ["broker", "worker", "repository-worker", "gateway"]
    for key in ("depends_on:", "profiles:", "build:", "restart:", "ports:", "keys:/keys"):
        assert key not in swarm, key
    # the one volume under Swarm: the model repository, mounted by the repository workers
    assert (
        re.findall(r"^  (\w+):$", swarm[: swarm.index("\nservices:\n")], re.M).count("repository")
        == 1
    )
    assert re.findall(r"volumes: \[(.*)\]", swarm) == ['"repository:/repository:ro"']
    assert re.search(r"^ *#swarm ", swarm, re.MULTILINE) is None
    # Every secret a service mounts is declared, and each at a path of the Compose volume.
    declared = set(re.findall(r"^  (\w+):\n    file: ", swarm, re.MULTILINE))
    mounted = re.findall(r"\{source: (\w+), target: (/keys/\S+),", swarm)
    assert {source for source, _ in mounted} == declared
    assert all(target.startswith("/keys/") for _, target in mounted)


def test_the_swarm_filter_is_the_one_the_docs_show() -> None:
    """compose.yaml's header and docs/deploy.md show the command the tests run."""
    sed = shlex.join(SWARM_FILTER)
    assert sed in (ROOT / "compose.yaml").read_text()
    assert sed in (ROOT / "docs" / "deploy.md").read_text()


def healthchecks(text: str) -> dict[str, str]:
    """Service -> its health check's ``test:`` (the text up to the next key)."""
    body = text[text.index("\nservices:\n") :]
    found = {}
    for block in re.split(r"^  (?=[a-z][\w-]*:$)", body, flags=re.MULTILINE)[1:]:
        test = re.search(r"^    healthcheck:\n      test:(.*?)^      \w", block, re.M | re.S)
        if test:
            found[block.split(":", 1)[0]] = test.group(1)
    return found


def test_health_checks_are_probes_not_scripts() -> None:
    """Each long-running service's check GETs its own /ready with `ipuserve health`
    (the image has no curl): no Python snippet, no client of the fabric."""
    checks = healthchecks((ROOT / "compose.yaml").read_text())
    ready = {
        "broker": "http://127.0.0.1:9100/ready",
        "worker": "http://127.0.0.1:9100/ready",
        "repository-worker": "http://127.0.0.1:9100/ready",
        "gateway": "http://127.0.0.1:8000/v2/health/ready",
    }
    assert sorted(checks) == sorted(ready)
    for service, test in checks.items():
        assert "python" not in test and "-c" not in test, service
        argv = re.fullmatch(r"\s*\[(.*)\]\s*", test, re.S)
        assert argv is not None, f"{service}: one exec form line"
        assert [a.strip().strip('"') for a in argv.group(1).split(",")][:4] == [
            "CMD",
            "ipuserve",
            "health",
            ready[service],
        ], service
    # the port each probe asks is the one its service serves on, inside
    text = (ROOT / "compose.yaml").read_text()
    assert '"0.0.0.0:8000"' in text
    for service in ("broker", "worker"):
        assert f'IPUSERVE_{service.upper()}_METRICS_PORT: "9100"' in text, service
        assert f"IPUSERVE_{service.upper()}_METRICS_HOST: 0.0.0.0" in text, service
    assert checks == healthchecks(swarm_view())  # Swarm runs the same
