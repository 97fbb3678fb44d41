"""OpenAI's chat and text completions: request bodies (schemas.py), a request -> one `Plan`
(params.py, tools.py, tokenizer.py), its engine outputs (generation.py) and the bodies and
streams that answer it (bodies.py, sse.py).
"""
