"""Backends that run a model: vLLM (the engine) and transformers (the reference)."""
