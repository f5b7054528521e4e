"""The gRPC control plane (server and typed client) and the weight data plane (transport/).

Nothing here imports JAX, torch or vLLM at module import time.
"""
