"""Integration tests: the shared process fixture (every process killed at teardown)."""

from __future__ import annotations

from tests.client.faces import make_client  # noqa: F401  (a fixture)
from tests.helpers import processes  # noqa: F401  (a fixture)
from tests.integration.fleet import models, procs  # noqa: F401  (fixtures)
