"""Click commands owned by ipuserve.broker (mounted by ipuserve.cli)."""

from __future__ import annotations

import click

commands: list[click.Command] = []
