"""Fixtures of the integration tests: `cluster_box` (hosts as network namespaces)."""

from tests.integration.cluster_harness import cluster_box

__all__ = ["cluster_box"]
