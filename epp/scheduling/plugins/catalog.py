"""The built-in plugin catalog: every built-in plugin type, registered in one place.

Only the config loader imports this module; plugins import the framework
(:mod:`epp.framework`), never the config package or this catalog.
"""

from __future__ import annotations

from epp.datalayer import models
from epp.discovery.llmd_file import FileDiscovery, MultiClusterFileDiscovery
from epp.flowcontrol.llmd import LLMD_FLOW_CONTROL_PLUGINS
from epp.flowcontrol.plugins import FLOW_CONTROL_PLUGINS
from epp.framework.registry import Registry
from epp.parsing.parsers import BUILTIN_PARSERS
from epp.requestcontrol import agent_identity, rollout_screener
from epp.scheduling.plugins import (
    admitters,
    affinity,
    attributes,
    concurrency,
    conformance,
    datalayer,
    dcgm,
    filters,
    handlers,
    header_affinity,
    latency_admitter,
    latency_filter,
    latency_monolith,
    latency_producer,
    latency_scorer,
    llmd_filters,
    llmd_handlers,
    llmd_producers,
    load,
    lora,
    multicluster,
    multimodal_cache,
    nohit,
    pd,
    pickers,
    precise_prefix,
    predicted_ttft,
    prefix,
    reporter,
    roles,
    saturation,
    scorers,
    session,
    token_producer,
    topology,
    topology_llmd,
)

BUILTIN_PLUGINS: tuple[type, ...] = (
    handlers.SingleProfileHandler,
    pickers.MaxScorePicker,
    pickers.RandomPicker,
    pickers.WeightedRandomPicker,
    scorers.QueueScorer,
    scorers.KVCacheUtilizationScorer,
    scorers.RunningRequestsSizeScorer,
    prefix.PrefixCacheScorer,
    prefix.ApproxPrefixCacheProducer,
    pd.DisaggProfileHandler,
    pd.PdProfileHandler,
    pd.PrefixBasedPDDecider,
    pd.AlwaysDisaggPDDecider,
    pd.AlwaysDisaggMultimodalDecider,  # issue 18: llm-d's E/P/D (encode stage)
    pd.PrefillHeaderHandler,
    pd.DisaggHeadersHandler,
    roles.DecodeFilter,
    roles.PrefillFilter,
    roles.EncodeFilter,
    roles.LeaderFilter,
    topology.TopologyAffinityScorer,
    lora.LoraAffinityScorer,
    load.LoadAwareScorer,
    load.ActiveRequestScorer,
    load.TokenLoadScorer,
    load.InFlightLoadProducer,
    session.SessionAffinityScorer,
    session.SessionAffinityFilter,  # issue 18: llm-d's session filter and these below
    attributes.EndpointAttributeFilter,
    attributes.EndpointAttributeScorer,
    header_affinity.HeaderLabelAffinityScorer,
    llmd_handlers.HeaderProfileHandler,
    llmd_handlers.DataParallelProfileHandler,
    nohit.NoHitLRUScorer,
    token_producer.TokenProducer,  # issue 15: llm-d's token-producer (and its old name)
    token_producer.LegacyTokenizer,
    precise_prefix.PrecisePrefixCacheProducer,  # issue 15: KV-event prefix routing
    precise_prefix.PrecisePrefixCacheScorer,
    precise_prefix.PendingPrefillScorer,
    predicted_ttft.PredictedTTFTScorer,  # issue 17: TTFT model (docs/plugins.md)
    filters.LabelSelectorFilter,
    filters.ByLabelSelectorFilter,
    filters.ByLabelFilter,  # llm-d's deprecated by-label
    saturation.UtilizationDetector,
    concurrency.ConcurrencyDetector,
    affinity.PrefixCacheAffinityFilter,
    latency_monolith.PredictedLatencyScorer,  # GIE's latency predictor (old monolith + new)
    latency_producer.PredictedLatencyProducer,
    latency_admitter.LatencySloAdmitter,
    latency_filter.SloHeadroomTierFilter,
    latency_scorer.LatencyScorer,
    conformance.HeaderBasedTestingFilter,
    conformance.DestinationEndpointServedVerifier,
    reporter.RequestAttributeReporter,
    datalayer.MetricsDataSource,
    datalayer.CoreMetricsExtractor,
    datalayer.EndpointNotificationSource,
    datalayer.K8sNotificationSource,
    dcgm.DCGMDataSource,
    dcgm.DCGMExtractor,
    models.ModelsDataSource,  # issue 18: llm-d's /v1/models source, its extractor
    models.ModelsExtractor,
    models.ServedModelsFilter,  # this project's consumer of the models attribute
    topology_llmd.TopologyExtractor,  # issue 18: llm-d's topology plugins
    topology_llmd.TopologyAffinityFilter,
    llmd_filters.UtilizationFilter,  # issue 18: llm-d's utilization-filter
    llmd_filters.ContextLengthAware,  # and context-length-aware (filter + scorer)
    *FLOW_CONTROL_PLUGINS,  # GIE's flow-control policies (epp/flowcontrol/plugins.py)
    *LLMD_FLOW_CONTROL_PLUGINS,  # llm-d-router's (epp/flowcontrol/llmd.py)
    admitters.ProbabilisticAdmitter,  # llm-d-router's probabilistic-admitter
    FileDiscovery,  # issue 18: llm-d's dataLayer.discovery (epp/discovery/llmd_file.py)
    MultiClusterFileDiscovery,
    *multicluster.MULTICLUSTER_PLUGINS,  # issue 18: llm-d's multicluster variants
    agent_identity.AgentIdentity,  # issue 18: llm-d's request control (and these below)
    llmd_producers.SessionIdProducer,
    llmd_producers.BurstPrefixCacheProducer,
    llmd_producers.P2PSourceProducer,
    multimodal_cache.MMEmbeddingsCacheProducer,
    multimodal_cache.MMEmbeddingsCacheScorer,
    rollout_screener.DisaggregatedSetRolloutScreener,
    *BUILTIN_PARSERS,  # openai-, passthrough-, vllmgrpc-, vllmhttp-, anthropic-, vertexai-parser
)


def default_registry() -> Registry:
    """A registry holding every built-in plugin type."""
    reg = Registry()
    for cls in BUILTIN_PLUGINS:
        reg.register_class(cls)
    return reg
