"""Every external key the EPP reads or writes: headers, metadata namespaces, labels.

Plugins and handlers import names from here; no string literal for an external key
appears anywhere else (design.md §9, rule 6).
"""

from collections.abc import Mapping
from typing import Final

# --- Request headers (input) ---
HEADER_PATH: Final = ":path"
HEADER_METHOD: Final = ":method"
HEADER_STATUS: Final = ":status"
HEADER_CONTENT_TYPE: Final = "content-type"
HEADER_CONTENT_LENGTH: Final = "content-length"
HEADER_REQUEST_ID: Final = "x-request-id"
HEADER_OBJECTIVE: Final = "x-gateway-inference-objective"
HEADER_FAIRNESS_ID: Final = "x-gateway-inference-fairness-id"
DEFAULT_FAIRNESS_ID: Final = "default-flow"  # GIE: a request without the header
HEADER_MODEL_REWRITE: Final = "x-gateway-model-name-rewrite"
HEADER_SESSION_TOKEN: Final = "x-session-token"
HEADER_SLO_TTFT_MS: Final = "x-slo-ttft-ms"  # slo-deadline-ordering-policy
HEADER_EXPLAIN: Final = "x-epp-explain"  # request: ask for it; response: the decision JSON
HEADER_TRACEPARENT: Final = "traceparent"

# --- Routing headers (output; never accepted from clients) ---
HEADER_DESTINATION: Final = "x-gateway-destination-endpoint"
HEADER_PREFILLER: Final = "x-prefiller-host-port"
# llm-d's E/P/D header: the encode endpoints chosen (``ip:port`` list, comma-separated),
# for the decode/prefill pod's sidecar to send the request's media to.
HEADER_ENCODERS: Final = "x-encoder-hosts-ports"
# llm-d's data-parallel header: the rank endpoint chosen, when the disagg handlers'
# ``primaryPort`` sends the request to the pod's primary port (its sidecar) instead.
HEADER_DATA_PARALLEL: Final = "x-data-parallel-host-port"
# Split response path (docs/architecture.md "Response observer"): the routing filter's
# gRPC initial metadata says responses come on a separate observability-mode stream; the
# EPP tags the routed request with a one-time token header the observer stream carries.
GRPC_MD_RESPONSE_PATH: Final = "x-epp-response-path"
RESPONSE_PATH_OBSERVER: Final = "observer"
HEADER_OBSERVE_TOKEN: Final = "x-epp-observe"
# llm-d's P2P KV pull source (p2p-source-producer): an inbound value is never passed on.
HEADER_KV_CACHE_SOURCE: Final = "x-kv-cache-source-host-port"
ROUTING_HEADERS: Final = (HEADER_DESTINATION, HEADER_PREFILLER, HEADER_ENCODERS,
                          HEADER_DATA_PARALLEL, HEADER_OBSERVE_TOKEN, HEADER_KV_CACHE_SOURCE)

# --- Dynamic metadata ---
METADATA_NAMESPACE_LB: Final = "envoy.lb"
METADATA_DESTINATION_KEY: Final = HEADER_DESTINATION
# llm-d's DestinationEndpointScoresKey (pkg/epp/metadata/consts.go): --emit-endpoint-scores.
METADATA_DESTINATION_SCORES_KEY: Final = "x-gateway-destination-endpoint-scores"
METADATA_SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
METADATA_SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"

# Envoy attributes the gateway may send with the response headers (ext_proc
# `response_attributes`), under the filter's own namespace: they tell the EPP when the
# upstream it chose could not be reached (docs/operations.md).
ATTRIBUTES_NAMESPACE: Final = "envoy.filters.http.ext_proc"
ATTRIBUTE_RESPONSE_FLAGS: Final = "response.flags"
ATTRIBUTE_UPSTREAM_ADDRESS: Final = "upstream.address"
# Envoy's ResponseFlag bit UF (upstream connection failure).
RESPONSE_FLAG_UPSTREAM_CONNECTION_FAILURE: Final = 0x20

# --- Content types ---
CONTENT_TYPE_SSE: Final = "text/event-stream"
CONTENT_TYPE_JSON: Final = "application/json"

# --- gRPC health service names ---
HEALTH_LIVENESS: Final = "liveness"
HEALTH_READINESS: Final = "readiness"
HEALTH_EXT_PROC: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
# The service GIE v1.5.0's Helm chart probes with one replica (no leader election); GIE's
# health server answers any name then (epp/server/health.py).
HEALTH_INFERENCE_EXTENSION: Final = "inference-extension"

# --- Endpoint labels ---
LABEL_ROLE: Final = "llm-d.ai/role"
LABEL_ROLE_DYNAMO: Final = "nvidia.com/dynamo-sub-component-type"
ROLE_PREFILL: Final = "prefill"
ROLE_DECODE: Final = "decode"
# llm-d's encode-filter keeps these roles (encode is the first stage: E -> P -> D).
ROLES_ENCODE_CAPABLE: Final = frozenset({"encode", "encode-prefill", "encode-prefill-decode"})
ROLES_DECODE_CAPABLE: Final = frozenset({"decode", "prefill-decode", "both", "decode-prefill",
                                         "encode-prefill-decode"})
ROLES_PREFILL_CAPABLE: Final = frozenset({"prefill", "encode-prefill", "encode-prefill-decode"})

# --- NVIDIA Grove pod labels (design.md §7) ---
LABEL_GROVE_PODCLIQUE: Final = "grove.io/podclique"
LABEL_GROVE_PCS_REPLICA: Final = "grove.io/podcliqueset-replica-index"
LABEL_GROVE_PODGANG: Final = "grove.io/podgang"
LABEL_GROVE_BASE_PODGANG: Final = "grove.io/base-podgang"
LABEL_GROVE_PCSG: Final = "grove.io/podcliquescalinggroup"
LABEL_GROVE_PCSG_REPLICA: Final = "grove.io/podcliquescalinggroup-replica-index"
LABEL_GROVE_POD_INDEX: Final = "grove.io/podclique-pod-index"
LABEL_GROVE_PCSG_POD_INDEX: Final = "grove.io/podcliquescalinggroup-pod-index"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"

# --- LeaderWorkerSet pod labels (multi-node groups; the leader is worker 0) ---
LABEL_LWS_WORKER_INDEX: Final = "leaderworkerset.sigs.k8s.io/worker-index"
LABEL_LWS_GROUP_KEY: Final = "leaderworkerset.sigs.k8s.io/group-key"  # same on every member
ANNOTATION_LWS_SIZE: Final = "leaderworkerset.sigs.k8s.io/size"  # pods in the group

# --- Grove's gang object (scheduler.grove.io): each PodGang lists its pod groups ---
K8S_PODGANG_GROUP_VERSION: Final = "scheduler.grove.io/v1alpha1"
K8S_PODGANG_PLURAL: Final = "podgangs"

# --- Node topology labels ---
LABEL_HOSTNAME: Final = "kubernetes.io/hostname"
LABEL_RACK: Final = "topology.kubernetes.io/rack"
LABEL_BLOCK: Final = "topology.kubernetes.io/block"
LABEL_ZONE: Final = "topology.kubernetes.io/zone"
LABEL_ENGINE: Final = "llm-d.ai/engine-type"
LABEL_ENGINE_GIE: Final = "inference.networking.k8s.io/engine-type"

# --- Config file ---
CONFIG_API_VERSIONS: Final = (
    "inference.networking.x-k8s.io/v1alpha1",
    "llm-d.ai/v1alpha1",
)
CONFIG_KIND: Final = "EndpointPickerConfig"

# --- Model-server engines (label values of LABEL_ENGINE / LABEL_ENGINE_GIE) ---
ENGINE_VLLM: Final = "vllm"
ENGINE_SGLANG: Final = "sglang"
ENGINE_TRTLLM_SERVE: Final = "trtllm-serve"
ENGINE_TRITON_TRTLLM: Final = "triton-tensorrt-llm"

# --- Model-server Prometheus metrics the scraper reads (design.md §6) ---
# vLLM
VLLM_WAITING: Final = "vllm:num_requests_waiting"
VLLM_RUNNING: Final = "vllm:num_requests_running"
VLLM_KV_USAGE: Final = "vllm:kv_cache_usage_perc"
VLLM_KV_USAGE_OLD: Final = "vllm:gpu_cache_usage_perc"  # vLLM before v0.10
VLLM_LORA_INFO: Final = "vllm:lora_requests_info"
VLLM_CACHE_CONFIG: Final = "vllm:cache_config_info"
VLLM_PREFIX_HITS: Final = "vllm:prefix_cache_hits_total"
VLLM_PREFIX_QUERIES: Final = "vllm:prefix_cache_queries_total"
LORA_RUNNING_LABEL: Final = "running_lora_adapters"
LORA_WAITING_LABEL: Final = "waiting_lora_adapters"
LORA_MAX_LABEL: Final = "max_lora"
VLLM_BLOCK_SIZE_LABEL: Final = "block_size"
VLLM_NUM_BLOCKS_LABEL: Final = "num_gpu_blocks"
# SGLang
SGLANG_WAITING: Final = "sglang:num_queue_reqs"
SGLANG_RUNNING: Final = "sglang:num_running_reqs"
SGLANG_KV_USAGE: Final = "sglang:token_usage"
SGLANG_CACHE_CONFIG: Final = "sglang:cache_config_info"
SGLANG_PAGE_SIZE_LABEL: Final = "page_size"
SGLANG_NUM_PAGES_LABEL: Final = "num_pages"
# trtllm-serve
TRTLLM_WAITING: Final = "trtllm_num_requests_waiting"
TRTLLM_RUNNING: Final = "trtllm_num_requests_running"
TRTLLM_KV_USAGE: Final = "trtllm_kv_cache_utilization"
TRTLLM_TOKENS_PER_BLOCK: Final = "trtllm_kv_cache_tokens_per_block"
TRTLLM_MAX_BLOCKS: Final = "trtllm_kv_cache_max_blocks"
# Triton with the TensorRT-LLM backend (label-selected series)
TRITON_REQUEST_METRICS: Final = "nv_trt_llm_request_metrics"
TRITON_REQUEST_TYPE_LABEL: Final = "request_type"
TRITON_REQUEST_WAITING: Final = "waiting"
TRITON_REQUEST_SCHEDULED: Final = "scheduled"
TRITON_KV_BLOCK_METRICS: Final = "nv_trt_llm_kv_cache_block_metrics"
TRITON_KV_BLOCK_TYPE_LABEL: Final = "kv_cache_block_type"
TRITON_KV_FRACTION: Final = "fraction"
TRITON_KV_TOKENS_PER_BLOCK: Final = "tokens_per"
TRITON_KV_MAX_BLOCKS: Final = "max"

# --- Kubernetes discovery and leader election (design.md §7) ---
K8S_POOL_GROUP: Final = "inference.networking.k8s.io"  # InferencePool v1
K8S_POOL_GROUP_ALPHA: Final = "inference.networking.x-k8s.io"  # InferencePool v1alpha2
K8S_POOL_VERSION: Final = "v1"
K8S_POOL_VERSION_ALPHA: Final = "v1alpha2"
K8S_POOL_PLURAL: Final = "inferencepools"
# Pod annotation: comma-separated target ports that take traffic (GIE's data-parallel ranks).
ANNOTATION_ACTIVE_PORTS: Final = "inference.networking.k8s.io/active-ports"
# Lease name: epp-<namespace>-<pool>.<suffix>, as GIE's EPP names it.
K8S_LEASE_SUFFIX: Final = "gateway-api-inference-extension.sigs.k8s.io"
ENV_NAMESPACE: Final = "NAMESPACE"  # pool namespace when --pool-namespace is not given
# InferenceObjective / InferenceModelRewrite (GIE apix/v1alpha2), namespaced, watched in pool mode.
K8S_OBJECTIVE_API_VERSION: Final = "inference.networking.x-k8s.io/v1alpha2"
K8S_OBJECTIVE_PLURAL: Final = "inferenceobjectives"
K8S_MODEL_REWRITE_PLURAL: Final = "inferencemodelrewrites"
K8S_OBJECTIVE_KIND: Final = "InferenceObjective"
K8S_MODEL_REWRITE_KIND: Final = "InferenceModelRewrite"
K8S_POOL_KIND: Final = "InferencePool"  # poolRef.kind's default

# --- Per-request plugin state shared with the core (LLMRequest.plugin_state) ---
PLUGIN_STATE_PREFIX_HIT_RATIO: Final = "prefix-cache.hit-ratio"
PLUGIN_STATE_PREFIX_HIT_BYTES: Final = "prefix-cache.hit-bytes"  # matched blocks × block chars
PLUGIN_STATE_REQUEST_BODY: Final = "request.body"  # the decoded JSON body (a dict), when there is one
# The latency-predictor plugins (epp/latency): per-endpoint predictions
# ({endpoint key: LatencyPredictionInfo}, GIE's LatencyPredictionInfoKey attribute), and what
# they hand the metrics observer (prediction durations; predicted latencies and SLO checks).
PLUGIN_STATE_LATENCY_PREDICTIONS: Final = "LatencyPredictionInfoKey"
PLUGIN_STATE_LATENCY_DURATIONS: Final = "latency.prediction-durations"
PLUGIN_STATE_LATENCY_OUTCOME: Final = "latency.outcome"

# --- The latency predictor (GIE's predicted-latency plugins) ---
HEADER_SLO_TPOT_MS: Final = "x-slo-tpot-ms"  # with HEADER_SLO_TTFT_MS: the request's SLOs
# GIE's latency-predictor sidecar client (sidecars/latencypredictorasync ConfigFromEnv):
# with either URL set the plugins use the sidecar; without, the in-process predictor.
ENV_TRAINING_SERVER_URL: Final = "TRAINING_SERVER_URL"
ENV_PREDICTION_SERVER_URL: Final = "PREDICTION_SERVER_URL"  # comma-separated
ENV_LATENCY_MAX_SAMPLE_SIZE: Final = "LATENCY_MAX_SAMPLE_SIZE"
ENV_LATENCY_FLUSH_INTERVAL_SEC: Final = "LATENCY_FLUSH_INTERVAL_SEC"
ENV_LATENCY_USE_NATIVE_XGBOOST: Final = "LATENCY_USE_NATIVE_XGBOOST"
ENV_LATENCY_HTTP_TIMEOUT_SEC: Final = "LATENCY_HTTP_TIMEOUT_SEC"
ENV_LATENCY_METRICS_INTERVAL_SEC: Final = "LATENCY_METRICS_INTERVAL_SEC"
ENV_LATENCY_MAX_BULK_SIZE: Final = "LATENCY_MAX_BULK_SIZE"
ENV_LATENCY_COALESCE_WINDOW_MS: Final = "LATENCY_COALESCE_WINDOW_MS"
ENV_LATENCY_MAX_COALESCED_ROWS: Final = "LATENCY_MAX_COALESCED_ROWS"
ENV_LATENCY_MAX_CONCURRENT_DISPATCHES: Final = "LATENCY_MAX_CONCURRENT_DISPATCHES"


# llm-d-router v0.10.0 renamed these request headers (pkg/epp/metadata/consts.go) and reads
# the new name first, then GIE's as a deprecated alias; so does this EPP (request_header).
LLMD_HEADER_ALIASES: Final[dict[str, str]] = {
    HEADER_OBJECTIVE: "x-llm-d-inference-objective",
    HEADER_FAIRNESS_ID: "x-llm-d-inference-fairness-id",
    HEADER_MODEL_REWRITE: "x-llm-d-model-name-rewrite",
    HEADER_SLO_TTFT_MS: "x-llm-d-slo-ttft-ms",
    HEADER_SLO_TPOT_MS: "x-llm-d-slo-tpot-ms",
}


def request_header(headers: Mapping[str, str], name: str) -> str | None:
    """A request header by its GIE name: llm-d's new name for it first (when it has one),
    then ``name`` itself (llm-d's ``GetLowerCaseHeaderValue``)."""
    new = LLMD_HEADER_ALIASES.get(name)
    if new is not None:
        v = headers.get(new)
        if v is not None:
            return v
    return headers.get(name)
