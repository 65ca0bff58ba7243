"""A fake Kubernetes API server (list/watch, leases) for tests that need no cluster."""

from tests.k8s_fake.server import FakeApiServer

__all__ = ["FakeApiServer"]
