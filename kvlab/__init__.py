"""kvlab: moving an LLM's KV cache from prefill to decode across parallel layouts, verified."""

__version__ = "0.1.0"
