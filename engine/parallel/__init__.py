"""Tensor parallelism: which slice a rank holds (partition.py), the collectives and rank 0's
messages (collectives.py), and the worker processes (workers.py).
"""
