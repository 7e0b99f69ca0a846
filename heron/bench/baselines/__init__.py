"""Baseline servers measured by the same client as heron: a naive transformers server and llama.cpp."""
