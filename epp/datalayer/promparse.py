"""A Prometheus text-format (0.0.4) parser, fast when only a few metric names are wanted.

The grammar is the one Prometheus' own ``expfmt`` text parser reads: lines separated by
``\\n``; blank lines ignored; leading blanks and tabs allowed; ``#`` lines are comments,
of which ``# HELP name text`` and ``# TYPE name type`` are checked; a sample line is a
metric name, an optional label set ``{name="value",…}`` (escapes ``\\\\``, ``\\"``,
``\\n``; a trailing comma allowed; blanks allowed between tokens), a value (a float,
``NaN``, ``+Inf``, ``-Inf``) and an optional integer timestamp in milliseconds.

Two ways in, sharing one tokenizer for sample lines:

- :func:`parse` (``names=None``) reads every line and raises :class:`ParseError` on the
  first malformed one: the strict reference, used by tests and tools.
- :class:`SampleIndex` tokenizes only the sample lines of the names looked up, found
  with ``str.find``; it is what the scraper uses (see its docstring for exactly what it
  checks). ``parse(text, names)`` is a convenience over it.

Measured against ``prometheus_client.parser`` in docs/benchmarks.md (bench/promparse.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import NamedTuple

__all__ = ["ParseError", "Sample", "SampleIndex", "parse"]

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
        k = line.find(ch, 0, end)
        if k != -1:
            end = k
    name = line[:end]
    if not _valid_metric_name(name):
        raise _LineError(f"invalid metric name {name!r}")
    i = end
    if i < n and line[i] in _BLANKS:
        i = _skip_blanks(line, i, n)
    labels: dict[str, str] = {}
    if i < n and line[i] == "{":
        i += 1
        while True:
            if i < n and line[i] in _BLANKS:
                i = _skip_blanks(line, i, n)
            if i >= n:
                raise _LineError("unterminated label set")
            if line[i] == "}":
                i += 1
                break
            eq = line.find("=", i)
            if eq == -1:
                raise _LineError("expected '=' after label name")
            lname = line[i:eq]
            if not (lname.isascii() and lname.isidentifier()):
                lname = lname.rstrip(_BLANKS)
                if not _valid_label_name(lname):
                    raise _LineError(f"invalid label name {lname!r}")
            i = eq + 1
            if i < n and line[i] != '"':
                i = _skip_blanks(line, i, n)
            if i >= n or line[i] != '"':
                raise _LineError(f"expected '\"' to start the value of label {lname!r}")
            i += 1
            q = line.find('"', i)
            if q == -1:
                raise _LineError("unterminated label value")
            if line.find("\\", i, q) == -1:
                value = line[i:q]
                i = q + 1
            else:
                value, i = _unescape(line, i)
            if lname in labels:
                raise _LineError(f"duplicate label {lname!r}")
            labels[lname] = value
            if i < n and line[i] in _BLANKS:
                i = _skip_blanks(line, i, n)
            if i < n:
                c = line[i]
                i += 1
                if c == ",":
                    continue
                if c == "}":
                    break
            raise _LineError("expected ',' or '}' in label set")
        if i < n and line[i] not in _BLANKS:
            raise _LineError("expected a blank between the label set and the value")
        i = _skip_blanks(line, i, n)
    if i >= n:
        raise _LineError(f"missing value for {name!r}")
    j = line.find(" ", i)
    if j == -1:
        j = n
    k = line.find("\t", i, j)
    if k != -1:
        j = k
    value_f = _number(line[i:j], "value")
    if j == n:
        return Sample(name, labels, value_f, None)
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

    Without ``names`` every line is read and checked. With ``names`` only those sample
    names are read, through :class:`SampleIndex` (see there for what is and is not
    checked then); names absent from the text are absent from the result. Raises
    :class:`ParseError` on a malformed line that is read.
    """
    if names is None:
        return _scan_lines(text, None)
    index = SampleIndex(text)
    out: dict[str, list[Sample]] = {}
    for name in names:
        found = index.get(name)
        if found:
            out[name] = list(found)
    return out


class SampleIndex(Mapping[str, Sequence[Sample]]):
    """Lazy, per-name access to the samples of one text body: the scraper's fast path.

    ``index[name]`` tokenizes only the sample lines named ``name`` (KeyError when there
    are none) and remembers them; :class:`ParseError` is raised from the lookup when one
    of those lines is malformed. Lines of names never looked up are never read, so a
    syntax error in an unrelated metric goes unnoticed — deliberate: a model server's
    broken unrelated metric must not blind the scheduler.

    How lines are found: a label value cannot hold a raw newline, so a sample line of
    ``name`` is a line that starts with ``name`` followed by ``{``, a blank or the line
    end. The first one is found with ``str.find`` (C speed); the format requires all
    lines of a metric family to form one group with its ``# HELP``/``# TYPE`` lines
    first, so further lines are looked for only up to the next comment line (the next
    family), not through the whole body. Sample lines indented with blanks (allowed by
    the format, written by no Prometheus client library) are not found here; the full
    :func:`parse` reads them.

    ``line_cache``, when given, maps a line's text to its parsed :class:`Sample` and is
    shared across bodies: lines that did not change since the last scrape (info metrics,
    idle gauges) cost a dict lookup. Cached samples' ``labels`` are shared: read-only.
    The caller owns the cache; it is cleared when it exceeds ``line_cache_max`` entries.
    """

    __slots__ = ("_cache", "_cache_max", "_found", "_text")

    def __init__(self, text: str, line_cache: dict[str, Sample] | None = None,
                 line_cache_max: int = 8192) -> None:
        self._text = text
        self._found: dict[str, tuple[Sample, ...]] = {}
        self._cache = line_cache
        self._cache_max = line_cache_max

    def _starts(self, name: str) -> list[int]:
        text = self._text
        n = len(text)
        ln = len(name)
        starts: list[int] = []
        if text.startswith(name) and (ln >= n or text[ln] in "{ \t\n"):
            pos = 0
            starts.append(0)
        else:
            needle = "\n" + name
            pos = text.find(needle)
            while pos != -1:
                j = pos + 1 + ln
                if j >= n or text[j] in "{ \t\n":
                    break
                pos = text.find(needle, j)
            if pos == -1:
                return starts
            pos += 1
            starts.append(pos)
        # Further lines of this name: within this family's group only.
        end = text.find("\n#", pos)
        if end == -1:
            end = n
        needle = "\n" + name
        i = text.find(needle, pos, end)
        while i != -1:
            j = i + 1 + ln
            if j >= n or text[j] in "{ \t\n":
                starts.append(i + 1)
            i = text.find(needle, j, end)
        return starts

    def _load(self, name: str) -> tuple[Sample, ...]:
        text = self._text
        cache = self._cache
        out: list[Sample] = []
        for s in self._starts(name):
            e = text.find("\n", s)
            line = text[s:] if e == -1 else text[s:e]
            sample = cache.get(line) if cache is not None else None
            if sample is None:
                try:
                    sample = _parse_sample(line.rstrip(_BLANKS))
                except _LineError as err:
                    raise ParseError(str(err), text.count("\n", 0, s) + 1) from None
                if cache is not None:
                    if len(cache) >= self._cache_max:
                        cache.clear()
                    cache[line] = sample
            out.append(sample)
        return tuple(out)

    def __getitem__(self, name: str) -> Sequence[Sample]:
        found = self._found.get(name)
        if found is None:
            found = self._found[name] = self._load(name)
        if not found:
            raise KeyError(name)
        return found

    def __iter__(self) -> Iterator[str]:
        """Every sample name in the body (a full read; not the fast path)."""
        return iter(_scan_lines(self._text, None))

    def __len__(self) -> int:
        return len(_scan_lines(self._text, None))
