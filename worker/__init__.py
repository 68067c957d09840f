"""The tuneyard worker: the Ray job entry point and the training engine it runs."""
