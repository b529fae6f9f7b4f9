"""Fixtures shared by the client tests."""

from tests.helpers import processes  # noqa: F401  (a fixture)
