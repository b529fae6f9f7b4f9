"""Click commands owned by ipuserve.runtime (mounted by ipuserve.face.cli)."""

from __future__ import annotations

import click

from ipuserve.runtime.model_cli import model as model_group
from ipuserve.runtime.tools_cli import tools as tools_group

commands: list[click.Command] = []
commands.append(model_group)
commands.append(tools_group)
