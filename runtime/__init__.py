"""ipuserve.runtime: a Python re-implementation of Graphcore Model Runtime on simulated IPUs."""
