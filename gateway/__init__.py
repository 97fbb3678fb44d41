"""Switchboard's HTTP face: an OpenAI-compatible API over the engine. Never imports torch.

app.py (routes) · schemas.py (request bodies) · params.py (request -> engine jobs, extension
points) · generation.py (one request's engine outputs) · responses.py / sse.py (OpenAI
bodies and streams) · auth.py / limits.py (tenants, admission) · errors.py · metrics.py ·
tokenizer.py · runtime.py (per-app state) · config.py / cli.py / server.py (`switchboard serve`)
· cluster.py / shared_adapters.py (state shared with other replicas through Redis).
"""
