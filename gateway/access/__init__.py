"""Who may do what: API keys -> tenants (auth.py), admission and rate limits (limits.py),
storage quotas (quota.py), what one request may carry (bounds.py) and connection rules
(connections.py).
"""
