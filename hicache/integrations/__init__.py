"""hicache's disk and shared tiers inside other engines: a vLLM secondary tier (`hicache.integrations.vllm`) and an
SGLang HiCache storage backend (`hicache.integrations.sglang`), over one engine-neutral chunk store (chunks.py).
Only this package imports either engine (the `vllm` and `sglang` extras); docs/integrations.md has the commands."""
