"""The simulated IPU: host inventory, device locks, cost model and the executor thread."""
