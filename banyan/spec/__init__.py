"""Proposers for speculative decoding (banyan/scheduler/speculation.py decides who gets guesses;
the runner checks them)."""
