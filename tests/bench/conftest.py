"""Fixtures shared by the bench tests."""

from tests.helpers import processes  # noqa: F401  (a fixture)
