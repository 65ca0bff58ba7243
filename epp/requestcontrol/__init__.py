"""The Director: admission, model rewrite, scheduling, request lifecycle hooks."""
