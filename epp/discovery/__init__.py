"""Endpoint discovery: the static list/file (static.py) and Kubernetes (kubernetes.py:
InferencePool or standalone selector, Pods and Nodes over list+watch)."""
