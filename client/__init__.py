"""ipuserve.client: the Python client of a broker; the infer and models commands.

Example::

    from ipuserve.client import Client

    with Client("tcp://broker:5555", timeout=10) as client:
        outputs = client.infer("mlp", {"input": batch})
"""

from ipuserve.client.client import Client
from ipuserve.client.config import ClientConfig, ClientStats
from ipuserve.client.pending import InferFuture
from ipuserve.client.timing import Timing

__all__ = ["Client", "ClientConfig", "ClientStats", "InferFuture", "Timing"]
