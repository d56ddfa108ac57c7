"""The estimator: ``estimate()`` and its result, `MemoryEstimate`."""
