"""ipuserve.bench: load generation, the fabric suite, the relay baseline, reports and plots.

The ``ipuserve bench`` command (:mod:`ipuserve.bench.cli`) drives a running deployment
through :class:`ipuserve.client.Client` (:mod:`ipuserve.bench.bench`,
:mod:`ipuserve.bench.loadgen`), or starts one itself on loopback and measures it
beside a bare pyzmq relay (:mod:`ipuserve.bench.suite`, :mod:`ipuserve.bench.relay`).
Dependencies point one way: this package imports the client; the client never
imports it, so an application that only sends requests loads none of this.

This is the installed tool. The scripts in ``benchmarks/`` (a source checkout only)
each answer one question with its pieces and record the figures in
docs/benchmarks.md; benchmarks/README.md lists them.
"""
