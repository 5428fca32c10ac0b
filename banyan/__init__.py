"""Banyan: an LLM inference and serving engine."""
