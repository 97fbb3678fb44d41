"""Batch -> tensors -> forward -> tokens: `ModelRunner` (model_runner.py) with its step inputs
(step_inputs.py) and CUDA graphs (cuda_graphs.py, piecewise_graphs.py); the models (models/),
how their weights load (loader.py) and synthetic ones for benchmarks (synthetic.py).
"""
