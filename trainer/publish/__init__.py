"""The trainer side of a weight push: JAX params -> engine tensors -> data plane -> engines.

`publisher.WeightPublisher` pushes a version (its module docstring tells the steps and the
elastic re-plans); `waits` holds its waits on the engines through the gateway and the
errors a push raises; `host_views` fetches the params to the host one tensor at a time.
"""

from trainer.publish.publisher import PushStats, WeightPublisher
from trainer.publish.waits import PushError

__all__ = ["PushError", "PushStats", "WeightPublisher"]
