"""Checkpoint I/O: HF safetensors folders in and out, and the real SmolLM2 model set-up."""
