"""Benchmark clients for OpenAI-compatible servers (`hicache bench ...`): httpx and the stdlib only."""
