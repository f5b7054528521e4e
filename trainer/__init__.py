"""The JAX trainer: model families, checkpoints, losses, the train step and the async loop."""
