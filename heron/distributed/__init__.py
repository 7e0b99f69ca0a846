"""Tensor parallelism: the process group of the ranks, and the executors that start and supervise them."""
