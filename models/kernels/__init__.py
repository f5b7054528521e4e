"""Native CPU kernels of the JAX engine, called from jitted code as XLA FFI custom calls.

Each kernel is one C++ file beside its Python wrapper; `models.kernels.build` compiles it
with the host's g++ (``-O3 -march=native``) on first use into a per-user cache, loads it and
registers its FFI targets. Where it cannot (no compiler, another platform than CPU,
``JAXRL_CPU_KERNELS=0``), each wrapper's caller keeps its XLA path. A kernel runs only where
its caller opts in (`models.kernels.scope.native_scope`: the JAX engine's decode loop and
prefill on one device; XLA cannot split a custom call's operands over a mesh).
"""
