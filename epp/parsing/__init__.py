"""Request parsing and response usage parsing.

:mod:`epp.parsing.parser` is the Parser extension point (the config's ``parser:``);
:mod:`epp.parsing.parsers` holds the built-in parser plugins (openai-, passthrough-,
vllmgrpc-, vllmhttp-parser). Their work is done in :mod:`epp.parsing.request` (an
OpenAI-compatible body into a validated :class:`ParsedRequest`: API type, model, the prompt
text used for prefix-cache affinity), :mod:`epp.parsing.usage` (token usage out of JSON or
SSE response bodies), :mod:`epp.parsing.vllm_grpc` (vLLM's gRPC engine messages, gRPC
framing) and :mod:`epp.parsing.vllm_http` (vLLM's ``/inference/v1/generate``). All are
pure, synchronous and free of I/O.
"""
