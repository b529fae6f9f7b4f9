"""Fixtures shared by the client tests."""

from tests.helpers import npy_files, processes  # noqa: F401  (fixtures)
