"""kvrows: the KV-cache state layer of LLM inference on MLX."""
