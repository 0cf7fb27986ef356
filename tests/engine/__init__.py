"""Capture engines against Hugging Face fp32: vLLM modes, families, TP, generation, check-model."""
