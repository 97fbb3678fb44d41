"""Stateful sessions: `/v1/sessions` (routes.py), a session's turn (turns.py) and where
histories live (store.py).
"""
