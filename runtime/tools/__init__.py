"""The Model Runtime tools (spec chapter 7): benchmarks of queues and callbacks, real-data runs."""
