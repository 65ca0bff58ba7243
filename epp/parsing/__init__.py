"""OpenAI-compatible request parsing and response usage parsing.

:mod:`epp.parsing.request` turns a request body into a validated :class:`ParsedRequest`
(API type, model, the prompt text used for prefix-cache affinity); :mod:`epp.parsing.usage`
reads token usage out of JSON or SSE response bodies. Both are pure, synchronous and free
of I/O; neither imports wire or domain code beyond :mod:`epp.errors` and the ``ApiType``
enum.
"""
