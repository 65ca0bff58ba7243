"""``models-data-source`` and ``models-data-extractor`` (llm-d-router v0.10.0,
pkg/epp/framework/plugins/datalayer/source/models, .../extractor/models and
.../attribute/models): the models each endpoint serves, from its OpenAI ``/v1/models``.

The source polls ``<scheme>://<pod IP>:<serving port><path>`` of every endpoint (run by
epp/datalayer/polling.py, like ``dcgm-data-source``) and parses the JSON body
``{"object": "list", "data": [{"id": ..., "parent": ...}, ...]}`` (a body that is not
that is a failed poll, logged once per change). Parameters, as llm-d: ``scheme``
(``http``; ``http`` or ``https``), ``path`` (``/v1/models``), ``insecureSkipVerify``
(true), ``caCertPath`` (a PEM bundle that verifies the server when
``insecureSkipVerify`` is false), ``clientCertPath``/``clientKeyPath`` (mTLS, both
together), ``interval`` (rounded to the base tick; every tick when unset). TLS settings
apply to ``https`` only and are loaded at startup: an unreadable file fails there.

The extractor (no parameters) stores each endpoint's list as llm-d's
``/v1/models/<extractor name>`` attribute (:class:`ModelData` entries: ``id`` and the
optional ``parent``, the base model of a LoRA adapter), replacing it on every successful
poll; a failed poll keeps the last list; a removed endpoint's list is dropped.
:meth:`ModelsExtractor.served_models` reads it. llm-d ships no consumer of this
attribute; here ``served-models-filter`` (below; this project's, not llm-d's) keeps
the endpoints that serve the request's model, and the extractor also sets the scalar
attribute ``/v1/models/<extractor name>/count`` (the number of served models and
adapters) that ``endpoint-attribute-filter``/``-scorer`` can read.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import orjson

from epp.datalayer.polling import client_tls_context
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.framework.params import NoParameters, ParameterError, config_warning, param
from epp.scheduling.plugins.datalayer import _path, _scheme
from epp.scheduling.plugins.dcgm import _interval
from epp.scheduling.types import CycleState, Endpoint, LLMRequest

log = logging.getLogger(__name__)

MODELS_DATA_SOURCE = "models-data-source"
MODELS_DATA_EXTRACTOR = "models-data-extractor"
SERVED_MODELS_FILTER = "served-models-filter"
#: What the source produces and the extractor reads (llm-d's ``*ModelResponse``).
DATA_MODELS = "models-response"
#: llm-d's ModelsAttributeKey ("/v1/models") before the producer name.
MODELS_ATTRIBUTE = "/v1/models"
MODELS_TYPE = "ModelDataCollection"


def models_key(producer: str = MODELS_DATA_EXTRACTOR) -> str:
    return f"{MODELS_ATTRIBUTE}/{producer or MODELS_DATA_EXTRACTOR}"


@dataclass(frozen=True, slots=True)
class ModelData:
    """One entry of ``/v1/models``: the model id and its parent (a LoRA adapter's base
    model; empty when none)."""

    id: str
    parent: str = ""


@dataclass(frozen=True, slots=True)
class ModelResponse:
    """The parsed ``/v1/models`` body."""

    object: str = ""
    data: tuple[ModelData, ...] = ()


class BadModelsResponse(ValueError):
    """A ``/v1/models`` body (or payload) of the wrong shape."""


def parse_models(text: str) -> ModelResponse:
    """The ``/v1/models`` JSON → :class:`ModelResponse`; BadModelsResponse on another shape (as
    Go's json.Unmarshal into the struct: a wrong type fails, unknown keys are ignored)."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise BadModelsResponse(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadModelsResponse(f"expected a JSON object, got {type(doc).__name__}")
    obj = doc.get("object")
    if obj is not None and not isinstance(obj, str):
        raise BadModelsResponse(f"'object' must be a string, got {obj!r}")
    raw = doc.get("data")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise BadModelsResponse(f"'data' must be a list, got {type(raw).__name__}")
    out: list[ModelData] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadModelsResponse(f"data[{i}] must be an object, got {m!r}")
        mid, parent = m.get("id"), m.get("parent")
        if mid is not None and not isinstance(mid, str):
            raise BadModelsResponse(f"data[{i}].id must be a string, got {mid!r}")
        if parent is not None and not isinstance(parent, str):
            raise BadModelsResponse(f"data[{i}].parent must be a string, got {parent!r}")
        out.append(ModelData(mid or "", parent or ""))
    return ModelResponse(obj or "", tuple(out))


# ------------------------------------------------------------------ models-data-source


def _opt_path(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a file path string, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelsDataSourceParameters:
    scheme: str = param("scheme", "http", parse=_scheme)
    path: str = param("path", "/v1/models", parse=_path)
    insecure_skip_verify: bool = param("insecureSkipVerify", True)
    ca_cert_path: str = param("caCertPath", "", parse=_opt_path)
    client_cert_path: str = param("clientCertPath", "", parse=_opt_path)
    client_key_path: str = param("clientKeyPath", "", parse=_opt_path)
    interval_s: float | None = param("interval", None, parse=_interval)


class ModelsDataSource:
    """Polls each endpoint's ``/v1/models`` (``GET <scheme>://<pod IP>:<port><path>``)."""

    type_name = MODELS_DATA_SOURCE
    Parameters = ModelsDataSourceParameters
    data_output = DATA_MODELS
    accept = "application/json"

    def __init__(self, name: str = MODELS_DATA_SOURCE, scheme: str = "http",
                 path: str = "/v1/models", insecure_skip_verify: bool = True,
                 interval_s: float | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.name = name
        self.scheme = scheme
        self.path = path
        self.port = 0  # the endpoint's own (serving) port
        self.insecure_skip_verify = insecure_skip_verify
        self.interval_s = interval_s
        self._tls = tls

    @classmethod
    def from_params(cls, name: str, params: ModelsDataSourceParameters,
                    handle: PluginHandle) -> ModelsDataSource:
        tls = None
        if params.scheme == "https":
            tls = client_tls_context(params.insecure_skip_verify, params.ca_cert_path,
                              params.client_cert_path, params.client_key_path)
        elif params.ca_cert_path or params.client_cert_path or params.client_key_path:
            config_warning(name, "caCertPath/clientCertPath/clientKeyPath apply to "
                           "scheme https only; ignored with http")
        return cls(name, params.scheme, params.path, params.insecure_skip_verify,
                   params.interval_s, tls)

    def url(self, endpoint: Endpoint) -> str:
        return f"{self.scheme}://{endpoint.key}{self.path}"

    def ssl_context(self) -> ssl.SSLContext | bool:
        """The TLS settings for https; False (no TLS options) for http."""
        return self._tls if self._tls is not None else False

    @staticmethod
    def parse(text: str) -> ModelResponse:
        return parse_models(text)


# --------------------------------------------------------------- models-data-extractor


class ModelsExtractor:
    """Stores each endpoint's served models (module doc). No parameters."""

    type_name = MODELS_DATA_EXTRACTOR
    Parameters = NoParameters
    data_input = DATA_MODELS

    def __init__(self, name: str = MODELS_DATA_EXTRACTOR) -> None:
        self.name = name or MODELS_DATA_EXTRACTOR
        self.key = models_key(self.name)
        self.count_key = f"{self.key}/count"
        self.produces: Mapping[str, str] = MappingProxyType({self.key: MODELS_TYPE})
        self._models: dict[str, tuple[ModelData, ...]] = {}

    @classmethod
    def from_params(cls, name: str, params: NoParameters,
                    handle: PluginHandle) -> ModelsExtractor:
        return cls(name)

    def extract_poll(self, payload: Any, endpoint: Endpoint) -> Mapping[str, float]:
        if not isinstance(payload, ModelResponse):
            raise BadModelsResponse(f"expected a /v1/models response, got {type(payload).__name__}")
        self._models[endpoint.key] = payload.data
        return {self.count_key: float(len(payload.data))}

    def served_models(self, endpoint: Endpoint | str) -> tuple[ModelData, ...] | None:
        """The endpoint's last polled models; None when never polled successfully."""
        key = endpoint if isinstance(endpoint, str) else endpoint.key
        return self._models.get(key)

    def endpoint_removed(self, key: str) -> None:
        self._models.pop(key, None)


# ---------------------------------------------------------------- served-models-filter


@dataclass(frozen=True)
class ServedModelsFilterParameters:
    models_producer_name: str = param("modelsProducerName", "")
    match_parent: bool = param("matchParent", False)
    on_missing: str = param("onMissing", "Pass")

    def __post_init__(self) -> None:
        if self.on_missing not in ("Pass", "Fail"):
            raise ParameterError("onMissing", f"must be 'Pass' or 'Fail', got "
                                 f"{self.on_missing!r}")


class ServedModelsFilter:
    """This project's consumer of ``/v1/models/<extractor>``: keeps the endpoints whose
    served models include the request's target model (``matchParent: true`` also
    accepts an endpoint serving an adapter whose parent is that model). Endpoints never
    polled successfully are kept (``onMissing: Pass``, default) or dropped (``Fail``).
    An empty result is returned as is (the request fails with no capacity, as for any
    filter that leaves nothing)."""

    type_name = SERVED_MODELS_FILTER
    Parameters = ServedModelsFilterParameters

    def __init__(self, name: str = SERVED_MODELS_FILTER, producer_name: str = "",
                 match_parent: bool = False, pass_on_missing: bool = True) -> None:
        self.name = name or SERVED_MODELS_FILTER
        self.producer_name = producer_name or MODELS_DATA_EXTRACTOR
        self.match_parent = match_parent
        self.pass_on_missing = pass_on_missing
        self.consumes: Mapping[str, str] = MappingProxyType(
            {models_key(self.producer_name): MODELS_TYPE})
        self.extractor: ModelsExtractor | None = None

    @classmethod
    def from_params(cls, name: str, params: ServedModelsFilterParameters,
                    handle: PluginHandle) -> ServedModelsFilter:
        return cls(name, params.models_producer_name, params.match_parent,
                   params.on_missing == "Pass")

    def bind(self, handle: PluginHandle) -> None:
        self.extractor = handle.named(self.producer_name, ModelsExtractor)
        if self.extractor is None:
            raise ConfigError(f"{self.name}: no {MODELS_DATA_EXTRACTOR} named "
                              f"{self.producer_name!r}: declare one fed by a "
                              f"{MODELS_DATA_SOURCE} in dataLayer.sources, or set "
                              "modelsProducerName")

    def serves(self, models: Sequence[ModelData], model: str) -> bool:
        return any(m.id == model or (self.match_parent and m.parent == model)
                   for m in models)

    def filter(self, state: CycleState, request: LLMRequest,
               endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        ext = self.extractor
        if ext is None:
            return endpoints
        model = request.target_model
        kept: list[Endpoint] = []
        for e in endpoints:
            models = ext.served_models(e)
            if models is None:
                if self.pass_on_missing:
                    kept.append(e)
            elif self.serves(models, model):
                kept.append(e)
        return kept
