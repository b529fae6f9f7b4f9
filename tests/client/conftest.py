"""Fixtures shared by the client tests."""

from tests.client.faces import make_client  # noqa: F401  (a fixture)
from tests.helpers import processes  # noqa: F401  (a fixture)
