"""The engine's step: `LLMEngine` (engine.py) schedules (scheduler.py), runs one of its step
modes and hands the sampled tokens to the output processor (output_processor.py: stop checks,
detokenizer.py, reasoning.py); `EngineCore` (loop.py) steps it and applies commands, apart
from how it is reached. A request's state is request.py.
"""
