"""The pure-JAX continuous-batching rollout backend.

Modules, bottom up: ``sampling`` (temperature / top-k / top-p with processed log-probs),
``stops`` (EOS, the length limit, forced end-of-think phrase), ``state`` (the slot
state), ``prefill`` (bucketed, memoised prefill), ``decode`` (the compiled decode loop, cache
donated), ``insert`` (slot substitution, plain or ``shard_map``-sharded), ``tp`` (a replica's
("data", "tp") mesh and the placement of its params and KV cache by the rules table),
``batcher`` (one
replica's scheduler), ``engine`` (replicas in threads: ``JaxEngine.generate`` /
``update_weights``), ``backend`` (the ``RolloutBackend`` seam).
"""
