"""The vLLM rollout backend (async engine, native weight-update API)."""
