"""Engines: the backend protocol, transformers, vLLM; forward, weights, KV."""
