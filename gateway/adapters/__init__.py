"""`/v1/adapters` (routes.py) and the adapter registry replicas share (store.py, shared.py).
"""
