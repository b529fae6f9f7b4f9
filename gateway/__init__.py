"""ipuserve.gateway: the Open Inference Protocol (KServe v2) front door of the fabric.

A stateless process serving HTTP and gRPC, reaching the brokers through one
:class:`~ipuserve.client.AsyncClient`. Protocol-neutral layer first, then the doors::

    tensors.py      datatypes <-> numpy, the Tensor both doors hand the service
    service.py      InferenceService: checks against the model, infer, metadata
    catalog.py      the fabric's model versions as last heard, refreshed; the default
    repository.py   Triton's model repository extension: index, load, unload
    model_config.py Triton's model configuration of a version; grpc.health.v1's answer
    stats.py        per-model-version counters (Triton's statistics extension)
    status.py       the one table: ipuserve error -> HTTP status, gRPC code
    auth.py         bearer tokens by role, closed by default, refusals counted
    config.py       GatewayConfig
    http_server.py  the HTTP door (aiohttp): routes, tokens, errors as JSON
    http_codec.py   its infer body, JSON and binary tensor data, both ways
    json_data.py    JSON ``data`` into typed arrays, strictly, bounded by the shape
    http_body.py    the body read within the limit, inflated with caps
    offload.py      large bodies decoded off the event loop
    http_guard.py   per connection: header deadline (TLS handshake included), write
                    timeout, connection caps in all and per address
    accept_guard.py its listening sockets, accepting with a back-off at EMFILE
    grpc_*.py       the gRPC door (grpcio's asyncio server); grpc_precheck.py checks
                    an infer message's tensor sizes before protobuf parses it
    app.py / cli.py one asyncio loop running both; ``ipuserve gateway``
    supervisor.py   ``--processes N``: N such processes on the same ports, restarted
                    when they die (a plain process manager: no asyncio, no client)

It imports the client and the common ground only (tests/test_layout.py). docs/gateway.md
lists the endpoints, the error and datatype tables and what is not supported.
"""
