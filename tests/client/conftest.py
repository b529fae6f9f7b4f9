"""Fixtures shared by the client tests."""

from tests.client.faces import make_client  # noqa: F401  (a fixture)
from tests.client.test_repository import (  # noqa: F401  (fixtures)
    fabric,  # a repository fabric with nothing loaded; unloads what a test loaded
    repo_fabric,  # a broker and a repository worker, one per test module
)
from tests.helpers import processes  # noqa: F401  (a fixture)
