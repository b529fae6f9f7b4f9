"""PopEF stand-in: the model file format of the simulated runtime."""
