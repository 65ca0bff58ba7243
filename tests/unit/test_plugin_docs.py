"""docs/plugins.md's Summary table lists every registered plugin type with its origin.

The Go type lists below were read from the Go EPPs' plugin registrations:
GIE v1.5.0 ``cmd/epp/runner/runner.go`` (``registerInTreePlugins``) and llm-d-router
v0.10.0 ``cmd/epp/runner/runner.go`` (``registerInTreePlugins``: ``Register``,
``RegisterDeprecated``, ``RegisterWithPluginDependencies``, ``RegisterAsDefaultProducer``),
each constant resolved in its package.
"""

from __future__ import annotations

import re
from pathlib import Path

from epp.scheduling.plugins.catalog import default_registry

DOC = Path(__file__).parents[2] / "docs" / "plugins.md"

#: GIE v1.5.0's registered plugin types (36).
GIE_TYPES = frozenset({
    "approx-prefix-cache-producer", "concurrency-detector", "core-metrics-extractor",
    "destination-endpoint-served-verifier", "edf-ordering-policy",
    "endpoint-notification-source", "fcfs-ordering-policy",
    "global-strict-fairness-policy", "header-based-testing-filter",
    "inflight-load-producer", "k8s-notification-source", "kv-cache-utilization-scorer",
    "latency-scorer", "latency-slo-admitter", "lora-affinity-scorer", "max-score-picker",
    "metrics-data-source", "openai-parser", "passthrough-parser",
    "predicted-latency-producer", "predicted-latency-scorer",
    "prefix-cache-affinity-filter", "prefix-cache-scorer", "queue-scorer", "random-picker",
    "request-attribute-reporter", "round-robin-fairness-policy",
    "running-requests-size-scorer", "single-profile-handler",
    "slo-deadline-ordering-policy", "slo-headroom-tier-filter",
    "static-usage-limit-policy", "token-load-scorer", "utilization-detector",
    "vllmgrpc-parser", "weighted-random-picker",
})

#: llm-d-router v0.10.0's registered plugin types (96, deprecated names included).
LLMD_TYPES = frozenset({
    "active-request-scorer", "agent-identity", "always-disagg-multimodal-decider",
    "always-disagg-pd-decider", "anthropic-parser", "approx-prefix-cache-producer",
    "burst-prefix-cache-producer", "by-label", "by-label-selector", "concurrency-detector",
    "context-length-aware", "core-metrics-extractor", "data-parallel-profile-handler",
    "dcgm-data-source", "dcgm-extractor", "decode-filter",
    "destination-endpoint-served-verifier", "disagg-headers-handler",
    "disagg-profile-handler", "disaggregatedset-rollout-screener", "edf-ordering-policy",
    "encode-filter", "endpoint-attribute-filter", "endpoint-attribute-scorer",
    "endpoint-notification-source", "fcfs-ordering-policy", "file-discovery",
    "global-strict-fairness-policy", "header-based-testing-filter",
    "header-label-affinity-scorer", "header-profile-handler", "inflight-load-producer",
    "k8s-notification-source", "kv-cache-utilization-scorer", "label-selector-filter",
    "latency-scorer", "latency-slo-admitter", "load-aware-scorer", "lora-affinity-scorer",
    "max-score-picker", "metrics-data-source", "mm-embeddings-cache-producer",
    "mm-embeddings-cache-scorer", "models-data-extractor", "models-data-source",
    "multicluster-approx-prefix-cache-producer", "multicluster-file-discovery",
    "multicluster-kv-cache-utilization-scorer", "multicluster-metrics-data-source",
    "multicluster-metrics-extractor", "multicluster-prefix-cache-scorer",
    "multicluster-queue-scorer", "multicluster-session-affinity-filter",
    "no-hit-lru-scorer", "openai-parser", "p2p-source-producer", "passthrough-parser",
    "pd-profile-handler", "precise-prefix-cache-producer", "precise-prefix-cache-scorer",
    "predicted-latency-producer", "prefill-filter", "prefill-header-handler",
    "prefix-based-pd-decider", "prefix-cache-affinity-filter", "prefix-cache-scorer",
    "priority-holdback-policy", "priority-then-time-eviction-order-policy",
    "probabilistic-admitter", "program-aware-fairness", "queue-scorer", "random-picker",
    "request-attribute-reporter", "round-robin-fairness-policy",
    "running-requests-size-scorer", "session-affinity-filter", "session-affinity-scorer",
    "session-id-producer", "sheddable-eviction-filter", "single-profile-handler",
    "slo-deadline-ordering-policy", "slo-headroom-tier-filter",
    "soft-reflective-ceiling-policy", "static-usage-limit-policy", "token-load-scorer",
    "token-producer", "tokenizer", "topology-affinity-filter", "topology-affinity-scorer",
    "topology-extractor", "utilization-detector", "utilization-filter", "vertexai-parser",
    "vllmgrpc-parser", "vllmhttp-parser", "weighted-random-picker",
})


def expected_origin(type_name: str) -> str:
    found = [o for o, names in (("GIE", GIE_TYPES), ("llm-d", LLMD_TYPES)) if type_name in names]
    return ", ".join(found) or "this project"


def summary_rows() -> dict[str, str]:
    text = DOC.read_text()
    start = text.index("## Summary")
    table = text[start:text.index("\n## ", start + 5)]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([a-z0-9-]+)`", cells[0]):
            rows.setdefault(name, cells[1])
    return rows


def test_every_go_type_is_registered_here() -> None:
    registered = set(default_registry().types)
    assert sorted(GIE_TYPES - registered) == []
    assert sorted(LLMD_TYPES - registered) == []


def test_every_registered_type_is_listed_with_its_origin() -> None:
    rows = summary_rows()
    registered = default_registry().types
    assert [t for t in registered if t not in rows] == []
    wrong = {t: (rows[t], expected_origin(t)) for t in registered
             if rows[t] != expected_origin(t)}
    assert wrong == {}
