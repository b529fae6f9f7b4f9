"""Click commands owned by ipuserve.worker (mounted by ipuserve.cli)."""

from __future__ import annotations

import click

commands: list[click.Command] = []
