"""Click commands owned by ipuserve.runtime (mounted by ipuserve.cli)."""

from __future__ import annotations

import click

from ipuserve.runtime.model_cli import model as model_group

commands: list[click.Command] = []
commands.append(model_group)
