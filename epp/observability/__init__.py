"""Exported metrics, logging."""
