"""Every external key the EPP reads or writes: headers, metadata namespaces, labels.

Plugins and handlers import names from here; no string literal for an external key
appears anywhere else (design.md §9, rule 6).
"""

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
HEADER_MODEL_REWRITE: Final = "x-gateway-model-name-rewrite"
HEADER_SESSION_TOKEN: Final = "x-session-token"

# --- Routing headers (output; never accepted from clients) ---
HEADER_DESTINATION: Final = "x-gateway-destination-endpoint"
HEADER_PREFILLER: Final = "x-prefiller-host-port"
ROUTING_HEADERS: Final = (HEADER_DESTINATION, HEADER_PREFILLER)

# --- Dynamic metadata ---
METADATA_NAMESPACE_LB: Final = "envoy.lb"
METADATA_DESTINATION_KEY: Final = HEADER_DESTINATION
METADATA_SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
METADATA_SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"

# --- Content types ---
CONTENT_TYPE_SSE: Final = "text/event-stream"
CONTENT_TYPE_JSON: Final = "application/json"

# --- gRPC health service names ---
HEALTH_LIVENESS: Final = "liveness"
HEALTH_READINESS: Final = "readiness"
HEALTH_EXT_PROC: Final = "envoy.service.ext_proc.v3.ExternalProcessor"

# --- Endpoint labels ---
LABEL_ROLE: Final = "llm-d.ai/role"
LABEL_ROLE_DYNAMO: Final = "nvidia.com/dynamo-sub-component-type"
LABEL_ENGINE: Final = "llm-d.ai/engine-type"
LABEL_ENGINE_GIE: Final = "inference.networking.k8s.io/engine-type"

# --- Config file ---
CONFIG_API_VERSIONS: Final = (
    "inference.networking.x-k8s.io/v1alpha1",
    "llm-d.ai/v1alpha1",
)
CONFIG_KIND: Final = "EndpointPickerConfig"
