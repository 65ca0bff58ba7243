"""The one polling helper of the test suite: wait for a condition, never for a fixed time.

``await eventually(predicate)`` calls ``predicate()`` until it returns something truthy
and returns that value; ``predicate`` may be a plain function or return an awaitable (an
``async def``, or a lambda around a coroutine call). It is bounded in time: after
``timeout`` seconds it fails with an :class:`AssertionError` that says what was awaited
and the last value (or exception) seen::

    await eventually(lambda: len(store) == 2)
    text = await eventually(scrape_when_counted, timeout=10, interval=0.1,
                            what="every stream counted")
    await eventually(ready, retry_on=(grpc.aio.AioRpcError,))  # errors mean "not yet"

An exception raised by ``predicate`` propagates at once, unless it is one of
``retry_on``: then it counts as "not yet" and is reported on timeout.

A fixed ``asyncio.sleep`` remains right only where the passing time is the point of the
test (pacing traffic, a "nothing changes during this window" check); say so where it is.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

__all__ = ["eventually"]

T = TypeVar("T")

_MAX_REPR = 300


@overload
async def eventually(predicate: Callable[[], Awaitable[T]], *, timeout: float = ...,
                     interval: float = ..., what: str | Callable[[], str] | None = ...,
                     retry_on: tuple[type[BaseException], ...] = ...) -> T: ...


@overload
async def eventually(predicate: Callable[[], T], *, timeout: float = ...,
                     interval: float = ..., what: str | Callable[[], str] | None = ...,
                     retry_on: tuple[type[BaseException], ...] = ...) -> T: ...


async def eventually(predicate: Callable[[], object], *, timeout: float = 5.0,
                     interval: float = 0.01, what: str | Callable[[], str] | None = None,
                     retry_on: tuple[type[BaseException], ...] = ()) -> object:
    """Poll ``predicate()`` every ``interval`` seconds until it returns a truthy value;
    return that value. Fail (``AssertionError``) once ``timeout`` seconds have passed,
    naming ``what`` was awaited (a string, or a function called only then to build it,
    e.g. to add a log tail; default: the predicate's source) and the last value or
    exception seen. ``interval`` 0 still yields to the event loop between checks."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
        except retry_on as exc:
            error = exc
        else:
            if result:
                return result
            last, error = result, None
        if loop.time() >= deadline:
            break
        await asyncio.sleep(interval)
    seen = (f"last exception: {type(error).__name__}: {_short(str(error))}" if error is not None
            else f"last value: {_short(repr(last))}")
    described = what() if callable(what) else what or _describe(predicate)
    raise AssertionError(f"timed out after {timeout}s waiting for {described} "
                         f"({seen})") from error


def _short(text: str) -> str:
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + "…"


def _describe(predicate: Callable[[], object]) -> str:
    """A lambda's source text (``lambda: h.keys() == []``), else the function's name."""
    name = getattr(predicate, "__qualname__", None) or repr(predicate)
    if getattr(predicate, "__name__", None) == "<lambda>":
        try:
            lines, _ = inspect.getsourcelines(predicate)
        except (OSError, TypeError):
            return name
        source = " ".join(line.strip() for line in lines)
        start = source.find("lambda")
        if start >= 0:
            return _short(_lambda_expression(source[start:]))
    return name


def _lambda_expression(text: str) -> str:
    """``text`` up to the end of the lambda that starts it (best effort: brackets are
    balanced, strings are not parsed): the call's other arguments are left out."""
    depth = 0
    body = text.find(":") + 1
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth < 0:
                return text[:i].rstrip()
        elif char == "," and depth == 0 and i >= body:
            return text[:i].rstrip()
    return text
