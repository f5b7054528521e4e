"""The engine side of the async loop: one worker loop, two backends (jax/, vllm/)."""
