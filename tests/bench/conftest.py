"""Fixtures shared by the bench tests."""

from tests.helpers import npy_files, processes  # noqa: F401  (fixtures)
