"""ipuserve.client: the Python client of a broker; the infer and models commands.

Example::

    from ipuserve.client import Client

    with Client("tcp://broker:5555", timeout=10) as client:
        outputs = client.infer("mlp", {"input": batch})

    with Client(["tcp://b1:5555", "tcp://b2:5555"]) as client:  # several brokers
        outputs = client.infer("mlp", {"input": batch})
"""

from ipuserve.client.async_client import AsyncClient
from ipuserve.client.base import RequestOptions
from ipuserve.client.client import Client
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.core import LinkInfo
from ipuserve.client.fleet import FleetModel, FleetWorker
from ipuserve.client.pending import InferFuture, Outputs
from ipuserve.client.repository import RepositoryIndex
from ipuserve.client.timing import Timing

__all__ = [
    "AsyncClient",
    "Client",
    "ClientConfig",
    "ClientStats",
    "FleetModel",
    "FleetWorker",
    "InferFuture",
    "LinkInfo",
    "Outputs",
    "RepositoryIndex",
    "RequestOptions",
    "Timing",
]
