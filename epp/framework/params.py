"""Plugin parameters: a frozen dataclass per plugin, decoded and validated here.

A plugin declares its parameters as a frozen dataclass, one field per config key::

    @dataclass(frozen=True)
    class Parameters:
        threshold: int = param("threshold", 128, minimum=1)
        timeout: float | None = param("requestTimeout", None, parse=parse_duration)

:func:`decode_params` builds it from the config's ``parameters`` mapping: a missing or
``null`` key takes the default; ``int``, ``float``, ``bool`` and ``str`` fields (and their
``| None`` forms) are type- and range-checked; a field with ``parse=`` is decoded by that
function (``parse(value, path)``, raising ``ConfigError``); checks across fields go in
``__post_init__`` and raise :class:`ParameterError` naming the key. Every message names
the key's path in the file.

Unknown keys: GIE's plugin factories decode parameters with ``json.Unmarshal``, which
ignores keys no field declares. So does this module by default: each unknown key is
reported once, as a warning naming its path (with a "did you mean" when a declared key
is close), and ignored. Under :func:`decoding` with ``strict=True`` (``epp check-config
--strict``, ``epp serve --strict-config``) an unknown key is an error instead. The switch
is set once by the config loader around the whole build; plugins never see it — a
``parse=`` function that reads a nested mapping reports its unknown keys with
:func:`report_unknown` and gets the same behaviour.

:class:`Params` is the older reader (``params.int("key", default)``, then
``params.done()``), kept for Python plugins written against it (docs/plugins.md).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import difflib
import logging
import re
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

from epp.errors import ConfigError

P = TypeVar("P")

log = logging.getLogger(__name__)


# ----------------------------------------------------------- unknown keys: warn or fail


@dataclass
class DecodePolicy:
    """How the decoders treat unknown keys while a config is built (:func:`decoding`).

    ``strict``: an unknown key is a :class:`ConfigError`; otherwise a warning.
    ``source``: the file (or ``--config-text``) put in front of each warning.
    ``warnings``: every warning issued, in order (the loader hands them to
    ``epp check-config``, which prints them).
    """

    strict: bool = False
    source: str = ""
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        text = f"{self.source}: {message}" if self.source else message
        if text not in self.warnings:
            self.warnings.append(text)
            log.warning("%s", text)


_POLICY: ContextVar[DecodePolicy | None] = ContextVar("epp_decode_policy", default=None)


@contextlib.contextmanager
def decoding(strict: bool = False, source: str = "") -> Iterator[DecodePolicy]:
    """Decode parameters under one policy (the config loader wraps a whole build in it)."""
    policy = DecodePolicy(strict, source)
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)


def current_policy() -> DecodePolicy:
    """The policy in force; outside :func:`decoding`, lenient with warnings logged only."""
    policy = _POLICY.get()
    return policy if policy is not None else DecodePolicy()


def suggest(name: str, candidates: Collection[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def report_unknown(path: str, unknown: Collection[str], accepted: Collection[str],
                   what: str = "parameter") -> None:
    """Keys under ``path`` that nothing reads: a :class:`ConfigError` under a strict
    policy, else one warning per key (the key is ignored, as GIE ignores it)."""
    if not unknown:
        return
    keys = sorted(unknown)
    accepts = ", ".join(sorted(accepted)) or "none"
    policy = current_policy()
    if policy.strict:
        where = ", ".join(f"{path}.{k}" for k in keys)
        hints = "".join(suggest(k, accepted) for k in keys)
        raise ConfigError(f"{where}: unknown {what}{hints}; this plugin accepts: {accepts} "
                          "(strict mode: check-config --strict or serve --strict-config; without it the parameter is ignored with a warning)")
    for k in keys:
        policy.warn(f"{path}.{k}: unknown {what}, ignored{suggest(k, accepted)}; "
                    f"this plugin accepts: {accepts}")


def config_warning(path: str, message: str) -> None:
    """A warning about a config value that is accepted (a deprecated spelling, a value
    with no effect here), reported through the policy in force."""
    current_policy().warn(f"{path}: {message}")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h)\s*$")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_META = "epp.param"


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


def positive_duration(value: Any, path: str) -> float:
    """:func:`parse_duration`, which must be > 0."""
    t = parse_duration(value, path)
    if not t > 0:
        raise ConfigError(f"{path}: must be > 0, got {t:g}s")
    return t


class ParameterError(ConfigError):
    """Raised by a parameters dataclass's ``__post_init__``: ``key`` is the config key at
    fault; the decoder puts the key's path in front of ``message``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@dataclass(frozen=True)
class _Spec:
    key: str
    minimum: float | None
    maximum: float | None
    parse: Callable[[Any, str], Any] | None


def param(key: str, default: Any = None, *, minimum: float | None = None,
          maximum: float | None = None,
          parse: Callable[[Any, str], Any] | None = None) -> Any:
    """A parameter field: its config ``key``, its default, optional bounds (int and float
    fields) or a ``parse(value, path)`` function for anything else."""
    return field(default=default, metadata={_META: _Spec(key, minimum, maximum, parse)})


@dataclass(frozen=True)
class NoParameters:
    """For plugins that take none: every key is unknown (:func:`report_unknown`)."""


def _base_type(t: Any) -> Any:
    """``int`` for ``int | None``; the type itself otherwise."""
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return t


def accepted_keys(cls: type[Any]) -> list[str]:
    """The config keys a parameters dataclass accepts, sorted."""
    return sorted(_key(f) for f in dataclasses.fields(cls))


def _key(f: dataclasses.Field[Any]) -> str:
    spec = f.metadata.get(_META)
    return spec.key if spec is not None else f.name


def decode_params(cls: type[P], raw: Any, path: str) -> P:
    """Decode and validate a plugin's ``parameters`` mapping into ``cls`` (module doc)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: parameters must be a mapping, got {type(raw).__name__}")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    report_unknown(path, set(raw) - set(fields), fields)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, f in fields.items():
        v = raw.get(key)
        if v is None:
            continue
        spec: _Spec | None = f.metadata.get(_META)
        values[f.name] = _decode(v, _base_type(hints[f.name]), spec, f"{path}.{key}")
    try:
        return cls(**values)
    except ParameterError as e:
        raise ConfigError(f"{path}.{e.key}: {e.message}") from None


def _decode(v: Any, t: Any, spec: _Spec | None, path: str) -> Any:
    if spec is not None and spec.parse is not None:
        return spec.parse(v, path)
    if t is bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{path}: expected true or false, got {v!r}")
        return v
    if t is str:
        if not isinstance(v, str):
            raise ConfigError(f"{path}: expected a string, got {v!r}")
        return v
    if t is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{path}: expected an integer, got {v!r}")
    elif t is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {v!r}")
    else:
        raise TypeError(f"{path}: parameter type {t!r} needs a parse= function")
    if spec is not None:
        if spec.minimum is not None and v < spec.minimum:
            raise ConfigError(f"{path}: must be >= {spec.minimum}, got {v}")
        if spec.maximum is not None and v > spec.maximum:
            raise ConfigError(f"{path}: must be <= {spec.maximum}, got {v}")
    return float(v) if t is float else v


class Params:
    """The older, imperative reader of a plugin's ``parameters`` mapping.

    Read each key with a typed getter; ``done()`` reports any key not read (a warning, or
    an error in strict mode: :func:`report_unknown`) with the path of the bad key.
    """

    def __init__(self, raw: Mapping[str, Any] | None, path: builtins.str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{path}: parameters must be a mapping, got {type(raw).__name__}")
        self._raw = dict(raw)
        self._read: set[builtins.str] = set()
        self.path = path

    def _get(self, key: builtins.str) -> Any:
        self._read.add(key)
        return self._raw.get(key)

    def int(self, key: builtins.str, default: builtins.int, *,
            minimum: builtins.int | None = None,
            maximum: builtins.int | None = None) -> builtins.int:
        v = self._get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, builtins.int):
            raise ConfigError(f"{self.path}.{key}: expected an integer, got {v!r}")
        if minimum is not None and v < minimum:
            raise ConfigError(f"{self.path}.{key}: must be >= {minimum}, got {v}")
        if maximum is not None and v > maximum:
            raise ConfigError(f"{self.path}.{key}: must be <= {maximum}, got {v}")
        return v

    def float(self, key: builtins.str, default: builtins.float, *,
              minimum: builtins.float | None = None,
              maximum: builtins.float | None = None) -> builtins.float:
        v = self._get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (builtins.int, builtins.float)):
            raise ConfigError(f"{self.path}.{key}: expected a number, got {v!r}")
        if minimum is not None and v < minimum:
            raise ConfigError(f"{self.path}.{key}: must be >= {minimum}, got {v}")
        if maximum is not None and v > maximum:
            raise ConfigError(f"{self.path}.{key}: must be <= {maximum}, got {v}")
        return builtins.float(v)

    def str(self, key: builtins.str, default: builtins.str | None) -> builtins.str | None:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, builtins.str):
            raise ConfigError(f"{self.path}.{key}: expected a string, got {v!r}")
        return v

    def bool(self, key: builtins.str, default: builtins.bool) -> builtins.bool:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, builtins.bool):
            raise ConfigError(f"{self.path}.{key}: expected true or false, got {v!r}")
        return v

    def duration(self, key: builtins.str, default: builtins.float) -> builtins.float:
        v = self._get(key)
        return default if v is None else parse_duration(v, f"{self.path}.{key}")

    def raw(self, key: builtins.str) -> Any:
        return self._get(key)

    def done(self) -> None:
        report_unknown(self.path, set(self._raw) - self._read, self._read)
