"""The `ipuserve worker` and `ipuserve broker` commands: options, env vars, clear failures."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ipuserve.cli import main


@pytest.mark.parametrize(
    ("command", "options"),
    [
        (
            "worker",
            [
                "--broker",
                "--model",
                "--name",
                "--replicas",
                "--batching-dim",
                "--batch-timeout-ms",
                "--ipus",
                "--credit",
                "--heartbeat-ms",
                "--worker-id",
                "--drain-timeout-ms",
                "IPUSERVE_WORKER_BROKER",
            ],
        ),
        (
            "broker",
            [
                "--frontend",
                "--backend",
                "--heartbeat-ms",
                "--liveness-ms",
                "--grace-ms",
                "--queue-limit",
                "--max-attempts",
                "--max-payload-bytes",
                "--metrics-port",
                "IPUSERVE_BROKER_FRONTEND",
            ],
        ),
    ],
)
def test_help_lists_every_option_with_its_env_var(command: str, options: list[str]) -> None:
    result = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for option in options:
        assert option in result.output


def test_a_worker_that_cannot_build_its_backend_fails_in_one_line(tmp_path: object) -> None:
    result = CliRunner().invoke(
        main, ["worker", "--broker", "tcp://127.0.0.1:1", "--model", "/nonexistent.popef"]
    )
    assert result.exit_code == 1
    assert result.output.startswith("Error: ")
    assert "Traceback" not in result.output


def test_broker_rejects_inconsistent_settings() -> None:
    result = CliRunner().invoke(
        main,
        [
            "broker",
            "--heartbeat-ms",
            "500",
            "--liveness-ms",
            "100",
            "--frontend",
            "tcp://127.0.0.1:*",
            "--backend",
            "tcp://127.0.0.1:*",
        ],
    )
    assert result.exit_code == 1
    assert "liveness_ms must be at least heartbeat_ms" in result.output


def test_broker_reports_an_endpoint_it_cannot_bind() -> None:
    result = CliRunner().invoke(main, ["broker", "--frontend", "bogus://x"])
    assert result.exit_code == 1
    assert "cannot bind bogus://x" in result.output
