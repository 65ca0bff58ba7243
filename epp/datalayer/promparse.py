"""A Prometheus text-format (0.0.4) parser, fast when only a few metric names are wanted.

The grammar is the one Prometheus' own ``expfmt`` text parser reads: lines separated by
``\\n``; blank lines ignored; leading blanks and tabs allowed; ``#`` lines are comments,
of which ``# HELP name text`` and ``# TYPE name type`` are checked; a sample line is a
metric name, an optional label set ``{name="value",…}`` (escapes ``\\\\``, ``\\"``,
``\\n``; a trailing comma allowed; blanks allowed between tokens), a value (a float,
``NaN``, ``+Inf``, ``-Inf``) and an optional integer timestamp in milliseconds.

Two entry points share one tokenizer for sample lines:

- :func:`parse` with ``names=None`` reads every line and raises :class:`ParseError` on
  the first malformed one.
- :func:`parse` with ``names`` tokenizes only the sample lines of those names. A label
  value cannot hold a raw newline (it must be escaped), so a sample line of name ``N`` is
  exactly a line that starts with ``N`` followed by ``{``, a blank or the end of the
  line: those lines are found with ``str.find`` over the whole body (C speed) and then
  tokenized in full. Lines of other names are not looked at, so a syntax error in them
  goes unnoticed — deliberate: a model server's unrelated metric must not blind the
  scheduler. Bodies with indented lines (allowed by the format, never produced by
  prometheus_client) fall back to a line-by-line scan so that such lines are found too.

Measured against ``prometheus_client.parser`` in docs/benchmarks.md (bench/promparse.py).
"""

from __future__ import annotations

from typing import Collection, Mapping, NamedTuple

__all__ = ["ParseError", "Sample", "parse"]

_BLANKS = " \t"
_NAME_END = "{ \t"
_METRIC_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})


class Sample(NamedTuple):
    """One sample line. ``labels`` is a fresh dict owned by the caller (treat as read-only)."""

    name: str
    labels: Mapping[str, str]
    value: float
    timestamp_ms: int | None = None


class ParseError(ValueError):
    """The text is not valid Prometheus text format; ``line`` is 1-based."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


class _LineError(Exception):
    """Raised inside one line; turned into :class:`ParseError` with the line number."""


def _valid_metric_name(name: str) -> bool:
    # [a-zA-Z_:][a-zA-Z0-9_:]* — ASCII identifiers after mapping ':' to '_'.
    return name.isascii() and name.replace(":", "_").isidentifier()


def _valid_label_name(name: str) -> bool:
    # [a-zA-Z_][a-zA-Z0-9_]*
    return name.isascii() and name.isidentifier()


def _skip_blanks(line: str, i: int, n: int) -> int:
    while i < n and line[i] in _BLANKS:
        i += 1
    return i


def _unescape(line: str, i: int) -> tuple[str, int]:
    """Read a label value starting after its opening quote; return (value, index after
    the closing quote)."""
    parts: list[str] = []
    while True:
        q = line.find('"', i)
        b = line.find("\\", i)
        if q == -1:
            raise _LineError("unterminated label value")
        if b == -1 or q < b:
            parts.append(line[i:q])
            return "".join(parts), q + 1
        parts.append(line[i:b])
        c = line[b + 1:b + 2]
        if c == "\\":
            parts.append("\\")
        elif c == '"':
            parts.append('"')
        elif c == "n":
            parts.append("\n")
        else:
            raise _LineError(f"invalid escape sequence '\\{c}' in label value")
        i = b + 2


def _number(token: str, what: str) -> float:
    # Python's float() also takes digit separators ('1_0'); the format does not.
    if "_" in token:
        raise _LineError(f"invalid {what} {token!r}")
    try:
        return float(token)
    except ValueError:
        raise _LineError(f"invalid {what} {token!r}") from None


def _parse_sample(line: str) -> Sample:
    """Tokenize one sample line (no leading blanks, no newline)."""
    n = len(line)
    end = n
    for ch in _NAME_END:
        k = line.find(ch)
        if k != -1 and k < end:
            end = k
    name = line[:end]
    if not _valid_metric_name(name):
        raise _LineError(f"invalid metric name {name!r}")
    i = _skip_blanks(line, end, n)
    labels: dict[str, str] = {}
    if i < n and line[i] == "{":
        i += 1
        while True:
            i = _skip_blanks(line, i, n)
            if i >= n:
                raise _LineError("unterminated label set")
            if line[i] == "}":
                i += 1
                break
            eq = line.find("=", i)
            if eq == -1:
                raise _LineError("expected '=' after label name")
            lname = line[i:eq].rstrip(_BLANKS)
            if not _valid_label_name(lname):
                raise _LineError(f"invalid label name {lname!r}")
            i = _skip_blanks(line, eq + 1, n)
            if i >= n or line[i] != '"':
                raise _LineError(f"expected '\"' to start the value of label {lname!r}")
            i += 1
            q = line.find('"', i)
            b = line.find("\\", i, q if q != -1 else n)
            if b == -1:
                if q == -1:
                    raise _LineError("unterminated label value")
                value = line[i:q]
                i = q + 1
            else:
                value, i = _unescape(line, i)
            if lname in labels:
                raise _LineError(f"duplicate label {lname!r}")
            labels[lname] = value
            i = _skip_blanks(line, i, n)
            if i < n and line[i] == ",":
                i += 1
                continue
            if i < n and line[i] == "}":
                i += 1
                break
            raise _LineError("expected ',' or '}' in label set")
        if i < n and line[i] not in _BLANKS:
            raise _LineError("expected a blank between the label set and the value")
        i = _skip_blanks(line, i, n)
    if i >= n:
        raise _LineError(f"missing value for {name!r}")
    j = i
    while j < n and line[j] not in _BLANKS:
        j += 1
    value_f = _number(line[i:j], "value")
    i = _skip_blanks(line, j, n)
    ts: int | None = None
    if i < n:
        j = i
        while j < n and line[j] not in _BLANKS:
            j += 1
        token = line[i:j]
        if "_" in token:
            raise _LineError(f"invalid timestamp {token!r}")
        try:
            ts = int(token)
        except ValueError:
            raise _LineError(f"invalid timestamp {token!r}") from None
        if _skip_blanks(line, j, n) < n:
            raise _LineError("unexpected text after the timestamp")
    return Sample(name, labels, value_f, ts)


def _check_comment(line: str) -> None:
    """Validate ``# HELP`` / ``# TYPE`` lines; other comments are free text."""
    parts = line[1:].split(None, 2)
    if not parts or parts[0] not in ("HELP", "TYPE"):
        return
    if len(parts) < 2:
        raise _LineError(f"{parts[0]} without a metric name")
    if not _valid_metric_name(parts[1]):
        raise _LineError(f"invalid metric name {parts[1]!r} in {parts[0]}")
    if parts[0] == "TYPE":
        kind = parts[2].strip() if len(parts) == 3 else ""
        if kind not in _METRIC_TYPES:
            raise _LineError(f"invalid metric type {kind!r} for {parts[1]!r}")


def _line_name(line: str) -> str:
    end = len(line)
    for ch in _NAME_END:
        k = line.find(ch)
        if k != -1 and k < end:
            end = k
    return line[:end]


def _scan_lines(text: str, names: Collection[str] | None) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.lstrip(_BLANKS)
        if not line:
            continue
        try:
            if line[0] == "#":
                if names is None:
                    _check_comment(line)
                continue
            if names is not None and _line_name(line) not in names:
                continue
            sample = _parse_sample(line.rstrip(_BLANKS))
        except _LineError as e:
            raise ParseError(str(e), lineno) from None
        out.setdefault(sample.name, []).append(sample)
    return out


def parse(text: str, names: Collection[str] | None = None) -> dict[str, list[Sample]]:
    """Samples by sample name, each list in document order.

    With ``names``, only those sample names are read (see the module docstring for what
    is and is not checked then); names absent from the text are absent from the result.
    Raises :class:`ParseError` on a malformed line that is read.
    """
    if names is None:
        return _scan_lines(text, None)
    if text[:1] in (" ", "\t") or "\n " in text or "\n\t" in text:
        return _scan_lines(text, names)
    n = len(text)
    out: dict[str, list[Sample]] = {}
    for name in names:
        ln = len(name)
        starts: list[int] = []
        if text.startswith(name) and (ln >= n or text[ln] in "{ \t\n"):
            starts.append(0)
        needle = "\n" + name
        i = text.find(needle)
        while i != -1:
            j = i + 1 + ln
            if j >= n or text[j] in "{ \t\n":
                starts.append(i + 1)
            i = text.find(needle, j)
        if not starts:
            continue
        samples: list[Sample] = []
        for s in starts:
            e = text.find("\n", s)
            if e == -1:
                e = n
            try:
                samples.append(_parse_sample(text[s:e].rstrip(_BLANKS)))
            except _LineError as err:
                raise ParseError(str(err), text.count("\n", 0, s) + 1) from None
        out[name] = samples
    return out
