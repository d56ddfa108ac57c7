"""One training step: the driver that runs a recipe, checkpointing and the optimizer into a `Program`."""
