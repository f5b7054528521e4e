"""Tensor-name mappings between JAX params and HF / vLLM tensors, one file per family."""
