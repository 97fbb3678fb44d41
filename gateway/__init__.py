"""Switchboard's HTTP face: an OpenAI-compatible API over the engine. Never imports torch.

main.py (`switchboard`) · app.py (routes) · schemas.py (request bodies) · params.py (a request
-> one typed `Plan`) · generation.py (one request's engine outputs) · responses.py / sse.py
(OpenAI bodies and streams) · auth.py / limits.py / bounds.py (tenants, admission) · errors.py ·
metrics.py · tokenizer.py · runtime.py (per-app state) · config.py / cli.py / server.py
(`switchboard serve`) · redis_store.py (every Redis key and client) with cluster.py,
registry.py, session_store.py, adapter_store.py, shared_adapters.py (state shared with other
replicas) · router/ (`switchboard router`). The engine is reached through
`engine.protocols` and `engine.messages` only.
"""
