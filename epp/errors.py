"""Errors that cross the wire/domain seam.

The ext_proc handler turns an :class:`EppError` into an Envoy ImmediateResponse with the
HTTP status and a JSON body ``{"error": {"message", "type", "code"}}``. Domain code raises
these; the wire layer knows nothing else about the domain.
"""

from __future__ import annotations


class EppError(Exception):
    """A request-level failure with the HTTP status the client should see."""

    status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, status: int | None = None, error_type: str | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if error_type is not None:
            self.error_type = error_type


class BadRequest(EppError):
    """Body not JSON, no ``model``, or an unsupported shape (400)."""

    status = 400
    error_type = "invalid_request_error"


class BodyTooLarge(EppError):
    """Request body larger than the configured limit (413)."""

    status = 413
    error_type = "request_too_large"


class NoCapacity(EppError):
    """Shed by admission, or every scheduling profile filtered to nothing (429)."""

    status = 429
    error_type = "rate_limit_exceeded"


class ServiceUnavailable(EppError):
    """No candidate endpoints: none ready, or the subset hint matched none (503)."""

    status = 503
    error_type = "service_unavailable"


class ConfigError(Exception):
    """A configuration problem found at startup. The message names file, path and fix."""
