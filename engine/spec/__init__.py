"""Speculative decoding from the context: drafts and their acceptance (speculative.py), the
overlapped loop on the device (loop.py) and the two step modes that run them (steps.py).
"""
