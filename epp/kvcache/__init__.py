"""Precise prefix-cache routing: vLLM KV-event decoding, block hashing, the block index and its ZMQ subscriber."""
