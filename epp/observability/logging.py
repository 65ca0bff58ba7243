"""Logging setup: text or JSON lines, with the structured fields log calls pass in
``extra`` (request_id, model, endpoints, …). No per-request logging at info.

GIE's EPP configures its logger with ``-v`` and controller-runtime's ``--zap-*`` flags;
``epp serve`` accepts the same flags and maps them onto Python logging here
(:func:`resolve`), next to its own ``--log-level`` and ``--log-format``:

- level: ``--log-level`` if given, else ``--zap-log-level`` (``debug``, ``info``,
  ``error``, or an integer N > 0 meaning logr verbosity N), else ``-v N``, else info.
  GIE logs per-request detail at verbosity 4 (DEBUG) and 5 (TRACE), everything an
  operator needs at 2 and below; this EPP logs per-request detail at Python's DEBUG, so
  a verbosity of 4 or more means debug and anything lower means info;
- format: ``--log-format`` if given, else ``--zap-encoder`` (``json`` → json,
  ``console`` → text), else json when ``--zap-devel=false`` (zap's production mode),
  else text;
- ``--zap-stacktrace-level`` (``info``, ``error``, ``panic``): records at or above that
  level carry the stack of the logging call (JSON key ``stacktrace``, as zap's);
- ``--zap-time-encoding`` (``epoch``, ``millis``, ``nanos``, ``iso8601``, ``rfc3339``,
  ``rfc3339nano``): how the JSON ``ts`` field (and the text line's time) is written;
  by default ``ts`` is epoch seconds, as GIE's JSON logs.
"""

from __future__ import annotations

import datetime
import logging
import sys
import traceback
from dataclasses import dataclass
from types import FrameType
from typing import Any

import orjson

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
# GIE's verbosity levels (pkg/common/observability/logging/const.go): DEFAULT 2,
# VERBOSE 3, DEBUG 4, TRACE 5. From DEBUG on, GIE logs per-request detail.
GIE_DEFAULT_VERBOSITY = 2
GIE_DEBUG_VERBOSITY = 4
ZAP_ENCODERS = {"json": "json", "console": "text"}
ZAP_LEVEL_WORDS = ("debug", "info", "error")  # controller-runtime's levelStrings
ZAP_STACKTRACE_LEVELS = {"info": logging.INFO, "error": logging.ERROR,
                         "panic": logging.CRITICAL}
# controller-runtime's timeEncodingFlag accepts "nanos"; its help text says "nano".
ZAP_TIME_ENCODINGS = ("epoch", "millis", "nanos", "nano", "iso8601", "rfc3339",
                      "rfc3339nano")


@dataclass(frozen=True)
class LogSettings:
    """What the root logger is set up with (:func:`setup`)."""

    level: str = "info"  # one of LEVELS
    fmt: str = "text"  # one of FORMATS
    stacktrace_level: int | None = None  # a Python level number; None: no stack traces
    time_encoding: str | None = None  # one of ZAP_TIME_ENCODINGS; None: the default


# ------------------------------------------------------------------ flag value parsers
# Each raises ValueError with the message Go's flag would give (the CLI turns it into a
# usage error).


def parse_zap_encoder(value: str) -> str:
    v = value.strip().lower()
    if v not in ZAP_ENCODERS:
        raise ValueError(f'invalid encoder value "{value}" (one of json, console)')
    return v


def parse_zap_log_level(value: str) -> str:
    """'debug', 'info', 'error' or a positive integer (as text)."""
    v = value.strip().lower()
    if v in ZAP_LEVEL_WORDS:
        return v
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f'invalid log level "{value}" (one of debug, info, error, or an '
                         "integer > 0)")
    return str(n)


def parse_zap_stacktrace_level(value: str) -> str:
    v = value.strip().lower()
    if v not in ZAP_STACKTRACE_LEVELS:
        raise ValueError(f'invalid stacktrace level "{value}" (one of info, error, panic)')
    return v


def parse_zap_time_encoding(value: str) -> str:
    v = value.strip().lower()
    if v not in ZAP_TIME_ENCODINGS:
        raise ValueError(f'invalid time-encoding value "{value}" (one of epoch, millis, '
                         "nanos, iso8601, rfc3339, rfc3339nano)")
    return v


def _verbosity_level(v: int) -> str:
    return "debug" if v >= GIE_DEBUG_VERBOSITY else "info"


def resolve(*, log_level: str | None = None, log_format: str | None = None,
            verbosity: int | None = None, zap_log_level: str | None = None,
            zap_encoder: str | None = None, zap_devel: bool | None = None,
            zap_stacktrace_level: str | None = None,
            zap_time_encoding: str | None = None) -> LogSettings:
    """The settings from this EPP's flags and GIE's (None: not given); values already
    parsed by the ``parse_*`` functions above."""
    if log_level is not None:
        level = log_level
    elif zap_log_level is not None:
        level = (zap_log_level if zap_log_level in ZAP_LEVEL_WORDS
                 else _verbosity_level(int(zap_log_level)))
    elif verbosity is not None:
        level = _verbosity_level(verbosity)
    else:
        level = "info"
    if log_format is not None:
        fmt = log_format
    elif zap_encoder is not None:
        fmt = ZAP_ENCODERS[zap_encoder]
    elif zap_devel is False:
        fmt = "json"
    else:
        fmt = "text"
    stack = (ZAP_STACKTRACE_LEVELS[zap_stacktrace_level]
             if zap_stacktrace_level is not None else None)
    return LogSettings(level=level, fmt=fmt, stacktrace_level=stack,
                       time_encoding=zap_time_encoding)


# ------------------------------------------------------------------------ formatting


def encode_time(created: float, encoding: str | None) -> Any:
    """``created`` (epoch seconds) as zap's time encoders write it."""
    if encoding is None or encoding == "epoch":
        return round(created, 6)
    if encoding == "millis":
        return round(created * 1e3, 3)
    if encoding in ("nanos", "nano"):  # a float holds microseconds exactly, not nanoseconds
        return round(created * 1e6) * 1000
    t = datetime.datetime.fromtimestamp(created).astimezone()
    if encoding == "iso8601":  # Go layout 2006-01-02T15:04:05.000Z0700
        offset = t.strftime("%z")
        return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}" + (
            "Z" if offset == "+0000" else offset)
    stamp = t.strftime("%Y-%m-%dT%H:%M:%S")
    if encoding == "rfc3339nano":
        frac = f"{t.microsecond:06d}".rstrip("0")
        stamp += f".{frac}" if frac else ""
    offset = t.strftime("%z")
    return stamp + ("Z" if offset == "+0000" else f"{offset[:3]}:{offset[3:]}")


class JsonFormatter(logging.Formatter):
    def __init__(self, time_encoding: str | None = None) -> None:
        super().__init__()
        self.time_encoding = time_encoding

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": encode_time(record.created, self.time_encoding),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stacktrace"] = record.stack_info
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self, time_encoding: str | None = None) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.time_encoding = time_encoding

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if self.time_encoding is None:
            return super().formatTime(record, datefmt)
        return str(encode_time(record.created, self.time_encoding))

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = {k: v for k, v in vars(record).items() if k not in _STD and not k.startswith("_")}
        return base + (" " + " ".join(f"{k}={v}" for k, v in extra.items()) if extra else "")


class StackTraceFilter(logging.Filter):
    """Attaches the logging call's stack to records at or above ``level``
    (``--zap-stacktrace-level``), unless they carry an exception or a stack already."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level and not record.exc_info and not record.stack_info:
            frame = _caller_frame(record)
            if frame is not None:
                record.stack_info = "Stack (most recent call last):\n" + "".join(
                    traceback.format_stack(frame)).rstrip("\n")
        return True


def _caller_frame(record: logging.LogRecord) -> FrameType | None:
    """The frame of the logging call that made ``record`` (None when not on this stack,
    e.g. a record from another thread's queue)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_filename == record.pathname
                and frame.f_lineno == record.lineno):
            return frame
        frame = frame.f_back
    return None


def setup(settings: LogSettings) -> None:
    """Configure the root logger (once per process)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(settings.time_encoding) if settings.fmt == "json"
                         else TextFormatter(settings.time_encoding))
    if settings.stacktrace_level is not None:
        handler.addFilter(StackTraceFilter(settings.stacktrace_level))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, settings.level.upper()))


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger once: ``level`` by name, ``fmt`` 'text' or 'json'."""
    setup(LogSettings(level=level, fmt=fmt))
