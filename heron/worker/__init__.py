"""Runs the model: the persistent input batch, the KV pool and the forward pass."""
