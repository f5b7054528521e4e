"""The pure-JAX continuous-batching rollout backend."""
