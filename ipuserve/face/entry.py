"""The ``ipuserve`` console script (and ``python -m ipuserve``).

``ipuserve health`` runs every few seconds in every container (compose.yaml's health
checks), so it starts without importing the other commands: mounting them all
(:mod:`ipuserve.face.cli`: numpy, ZeroMQ, the runtime, the gateway's aiohttp and
gRPC) took ~0.4 s of CPU per check, against ~0.05 s for the check alone. Everything
else goes through the one click group.
"""

from __future__ import annotations

import sys


def run() -> None:
    if sys.argv[1:2] == ["health"]:
        from ipuserve.face.health import health

        # the group's prefix and name, so options, variables and usage are the same
        health.main(sys.argv[2:], prog_name="ipuserve health", auto_envvar_prefix="IPUSERVE_HEALTH")
        return
    from ipuserve.face.cli import main

    main()
