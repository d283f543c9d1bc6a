"""The OpenAI-compatible HTTP server (`hicache serve`): app, wire format, metrics, trace log."""
