"""Worker tests: a fake broker (a bare ROUTER), nodes on threads, and process fixtures."""

from __future__ import annotations

from tests.helpers import processes  # noqa: F401  (a fixture)
