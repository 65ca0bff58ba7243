"""Endpoint and pool state, owned by one event loop."""
