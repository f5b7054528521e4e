"""The gRPC control plane: server and typed client (the weight data plane is `transport/`).

Nothing here imports JAX, torch or vLLM at module import time.
"""
