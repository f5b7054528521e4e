"""The model both sides run: flax NNX decoder families (llama, qwen2, qwen3, gemma3) configured
from HF config.json, their KV cache, HF safetensors checkpoints (`models.checkpoints`) and mesh
placement (`models.sharding`). Imports only `mappings`; the trainer, the JAX engine, the checker
and the benchmarks import it."""
