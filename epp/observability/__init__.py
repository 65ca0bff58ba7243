"""Exported metrics, explained decisions, tracing, logging; the decision observers."""
