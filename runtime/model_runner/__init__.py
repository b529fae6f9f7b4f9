"""ModelRunner: the high-level API of the Model Runtime."""
