"""`switchboard router`: one OpenAI-compatible front over several replicas sharing one Redis.

It sits beside the gateway it fronts and reuses its HTTP pieces; it imports no engine code.
gateway/registry.py (replicas register with a heartbeat; the router reads the live ones) ·
pool.py (which replica serves a request: session affinity, prefix, least load; the base-model
check) · proxy.py (forwarding, streaming included) · app.py (routes) · cli.py.
"""
