"""Endpoint discovery: the static list/file, and (later) Kubernetes."""
