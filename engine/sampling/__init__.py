"""From logits to tokens: a request's knobs (params.py, pure Python), a step's rows of them
(rows.py), the grammar masks (structured.py) and the draw (sampler.py, race.py over
counter_rng.py's noise).
"""
