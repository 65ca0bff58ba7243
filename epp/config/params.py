"""Strict reading of a plugin's ``parameters`` mapping.

Each plugin factory reads its parameters through :class:`Params`; ``done()`` rejects any
key the plugin did not read, so a typo fails at startup with the path of the bad key.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from epp.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h)\s*$")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, path: str) -> float:
    """Seconds from a Go-style duration string ('200ms', '1.5s') or a number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected a duration like '200ms', got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _UNITS[m.group(2)]
    raise ConfigError(f"{path}: expected a duration like '200ms' or '2s', got {value!r}")


class Params:
    def __init__(self, raw: Mapping[str, Any] | None, path: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path}: parameters must be a mapping, got {type(raw).__name__}")
        self._raw = dict(raw)
        self._read: set[str] = set()
        self.path = path

    def _get(self, key: str) -> Any:
        self._read.add(key)
        return self._raw.get(key)

    def int(self, key: str, default: int, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
        v = self._get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{self.path}.{key}: expected an integer, got {v!r}")
        if minimum is not None and v < minimum:
            raise ConfigError(f"{self.path}.{key}: must be >= {minimum}, got {v}")
        if maximum is not None and v > maximum:
            raise ConfigError(f"{self.path}.{key}: must be <= {maximum}, got {v}")
        return v

    def float(self, key: str, default: float, *, minimum: float | None = None,
              maximum: float | None = None) -> float:
        v = self._get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{self.path}.{key}: expected a number, got {v!r}")
        if minimum is not None and v < minimum:
            raise ConfigError(f"{self.path}.{key}: must be >= {minimum}, got {v}")
        if maximum is not None and v > maximum:
            raise ConfigError(f"{self.path}.{key}: must be <= {maximum}, got {v}")
        return float(v)

    def str(self, key: str, default: str | None) -> str | None:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise ConfigError(f"{self.path}.{key}: expected a string, got {v!r}")
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{self.path}.{key}: expected true or false, got {v!r}")
        return v

    def duration(self, key: str, default: float) -> float:
        v = self._get(key)
        return default if v is None else parse_duration(v, f"{self.path}.{key}")

    def raw(self, key: str) -> Any:
        return self._get(key)

    def done(self) -> None:
        unknown = sorted(set(self._raw) - self._read)
        if unknown:
            known = ", ".join(sorted(self._read)) or "none"
            where = ", ".join(f"{self.path}.{k}" for k in unknown)
            raise ConfigError(f"{where}: unknown parameter; this plugin accepts: {known}")
