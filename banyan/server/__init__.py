"""The OpenAI-compatible HTTP server (`banyan serve`): an API server process and an engine
process talking over ZMQ. See docs/architecture.md."""
