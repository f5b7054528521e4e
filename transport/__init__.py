"""The weight data plane: one interface, one module per transport (gloo, NCCL, file)."""
