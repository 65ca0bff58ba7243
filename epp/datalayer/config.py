"""The configured data layer (the config's ``dataLayer`` section) and what it drives.

The loader (epp/config/loader.py) builds a :class:`DataLayerConfig` from
``dataLayer.sources`` — or injects GIE's default, ``metrics-data-source`` feeding
``core-metrics-extractor``, when the section is absent; for llm-d documents
(``apiVersion: llm-d.ai/v1alpha1`` or llm-d-only ``dataLayer`` keys) llm-d's rule: the
pair is added beside the listed sources unless one is a metrics source or
``injectDefaults: false`` — and leaves it None under the
``enableLegacyMetrics`` feature gate (GIE's legacy metrics path: the scraper configured by
the flags alone, as before the data layer existed). The server turns it into the
scraper's settings with :func:`scraper_settings` and connects the endpoint notification
sources with :func:`attach_sources`; the polling sources (``dcgm-data-source``,
:func:`polling_sources`) run in epp/datalayer/polling.py; the ``k8s-notification-source``
watches are epp/datalayer/notifications.py's.

Precedence for the scrape URL, as in GIE: built-in default < ``--model-server-metrics-*``
flag < the ``metrics-data-source`` parameter. The metric-name flags
(``--total-queued-requests-metric`` …) still apply to the default engine's mapping on top
of the extractor's (GIE v1.5.0 refuses those flags; here they keep working).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from epp.datalayer.engines import EngineMappings, MappingOverrides
from epp.datalayer.polling import PollingExtractor, PollingSource
from epp.datalayer.scraper import ScrapeOptions
from epp.datastore.store import Datastore
from epp.framework.interfaces import (
    EVENT_ADD_OR_UPDATE,
    EVENT_DELETE,
    DataExtractor,
    DataSource,
    EndpointExtractor,
)
from epp.scheduling.plugins.datalayer import (
    CoreMetricsExtractor,
    EndpointNotificationSource,
    MetricsDataSource,
)
from epp.scheduling.types import Endpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceConfig:
    """One ``dataLayer.sources`` entry: a source plugin and the extractors it feeds."""

    source: DataSource
    extractors: tuple[DataExtractor, ...] = ()
    # "FILE: dataLayer.sources[i]" for errors found after loading ("" when injected).
    where: str = ""


@dataclass(frozen=True)
class DataLayerConfig:
    """The data layer the config asks for. ``injected``: the config had no ``dataLayer``
    section and the loader added GIE's default."""

    sources: tuple[SourceConfig, ...] = ()
    injected: bool = False

    def metrics_source(self) -> SourceConfig | None:
        """The ``metrics-data-source`` entry (the loader allows one), or None."""
        return next((s for s in self.sources if isinstance(s.source, MetricsDataSource)),
                    None)


def scraper_settings(data_layer: DataLayerConfig | None, enabled: bool,
                     scrape: ScrapeOptions, overrides: MappingOverrides,
                     ) -> tuple[ScrapeOptions, EngineMappings] | None:
    """The scraper's options and engine mappings, or None when nothing is scraped
    (``--no-metrics-scraping``, or a data layer without a metrics source or extractor).

    ``data_layer`` None (``enableLegacyMetrics``): the flags alone, as before."""
    if not enabled:
        return None
    if data_layer is None:
        return scrape, EngineMappings(overrides=overrides)
    entry = data_layer.metrics_source()
    if entry is None:
        log.info("data layer: no metrics-data-source configured; model-server metrics are "
                 "not scraped")
        return None
    extractors = [e for e in entry.extractors if isinstance(e, CoreMetricsExtractor)]
    if not extractors:
        log.warning("data layer: %s has no core-metrics-extractor; model-server metrics "
                    "are not scraped", entry.source.name)
        return None
    src = entry.source
    assert isinstance(src, MetricsDataSource)
    options = replace(
        scrape,
        scheme=src.scheme if src.scheme is not None else scrape.scheme,
        path=src.path if src.path is not None else scrape.path,
        insecure_skip_verify=(src.insecure_skip_verify if src.insecure_skip_verify is not None
                              else scrape.insecure_skip_verify),
    )
    return options.validate(), extractors[0].engine_mappings(overrides)


def attach_sources(data_layer: DataLayerConfig | None, store: Datastore) -> Callable[[], None]:
    """Connect the notification sources to ``store``: each ``endpoint-notification-source``
    tells its extractors about the endpoints there now and every later addition and
    removal. Returns a function that disconnects them."""
    undo: list[Callable[[], None]] = []
    for entry in data_layer.sources if data_layer is not None else ():
        if not isinstance(entry.source, EndpointNotificationSource):
            continue
        targets = [e for e in entry.extractors if isinstance(e, EndpointExtractor)]
        if not targets:
            continue
        for ep in store.snapshot():
            _dispatch(targets, EVENT_ADD_OR_UPDATE, ep)
        undo.append(store.on_added(_listener(targets, EVENT_ADD_OR_UPDATE)))
        undo.append(store.on_removed(_listener(targets, EVENT_DELETE)))

    def detach() -> None:
        for u in undo:
            u()
    return detach


def _listener(targets: list[EndpointExtractor], event: str) -> Callable[[Endpoint], None]:
    return lambda ep: _dispatch(targets, event, ep)


def _dispatch(targets: list[EndpointExtractor], event: str, ep: Endpoint) -> None:
    for t in targets:
        try:
            t.extract_endpoint(event, ep)
        except Exception:  # one extractor's bug must not break discovery (GIE logs it too)
            log.exception("data layer: endpoint extractor %s failed on %s %s", t.name, event,
                          ep.key)


def polling_sources(data_layer: DataLayerConfig | None,
                    ) -> list[tuple[PollingSource, list[PollingExtractor]]]:
    """The polling sources (``dcgm-data-source``) with their extractors, for
    :class:`~epp.datalayer.polling.PollingRunner` (a source without extractors is not
    polled: nothing would read what it fetches)."""
    out: list[tuple[PollingSource, list[PollingExtractor]]] = []
    for entry in data_layer.sources if data_layer is not None else ():
        if not isinstance(entry.source, PollingSource):
            continue
        targets = [e for e in entry.extractors if isinstance(e, PollingExtractor)]
        if targets:
            out.append((entry.source, targets))
        else:
            log.warning("data layer: %s has no extractor; it is not polled", entry.source.name)
    return out
