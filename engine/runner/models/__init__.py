"""The models, in plain torch: the Llama family (llama.py)."""
