"""The data layer: model-server metrics scraping (design.md §6).

- :mod:`epp.datalayer.promparse`: Prometheus text-format parser.
- :mod:`epp.datalayer.engines`: per-engine metric mappings (vLLM, SGLang, trtllm-serve,
  Triton TensorRT-LLM) and GIE's metric-spec syntax.
- :mod:`epp.datalayer.scraper`: :class:`~epp.datalayer.scraper.MetricsScraper`, one
  asyncio task per endpoint feeding the datastore.
"""
