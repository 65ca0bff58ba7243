"""The data layer: model-server metrics scraping (design.md §6).

- :mod:`epp.datalayer.promparse`: Prometheus text-format parser.
- :mod:`epp.datalayer.engines`: per-engine metric mappings (vLLM, SGLang, trtllm-serve,
  Triton TensorRT-LLM) and GIE's metric-spec syntax.
- :mod:`epp.datalayer.scraper`: :class:`~epp.datalayer.scraper.MetricsScraper`, one
  asyncio task per endpoint feeding the datastore.
- :mod:`epp.datalayer.config`: the config's ``dataLayer`` (sources and their extractors)
  and what it drives: the scraper's settings, ``endpoint-notification-source``.
- :mod:`epp.datalayer.notifications`: ``k8s-notification-source``'s list/watch.
- :mod:`epp.datalayer.dependencies`: GIE's check of the data plugins produce and consume.
"""
