"""Attention backends: one flat metadata per step, each backend owning its KV layout."""
