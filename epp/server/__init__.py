"""Server lifecycle: gRPC ext_proc + health, metrics HTTP, endpoint sources."""
