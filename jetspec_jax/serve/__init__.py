"""Serving: an engine of sequence slots with continuous batching (engine.py, slots.py, budget.py) and an
OpenAI-compatible HTTP layer over it (http_server.py, protocol.py); `python -m jetspec_jax.serve`."""
