"""Flax NNX decoder families (llama, qwen2, qwen3, gemma3) configured from HF config.json."""
