"""The config's ``flowControl:`` section, in two phases like the rest of the config.

GIE v1.5.0: ``FlowControlConfig`` / ``PriorityBandConfig`` in
apix/config/v1alpha1/endpointpickerconfig_types.go (keys), pkg/epp/flowcontrol/config.go,
controller/config.go and registry/config.go (defaults, validation), and the loader's
``ensureFlowControlLayer`` (default policy plugins). The section is read only under the
``flowControl`` feature gate (GIE ignores it otherwise, after decoding it strictly).

Phase 1, :func:`parse_flow_control`: keys and value types → :class:`FlowControlSpec`
(frozen). Unknown keys are errors (GIE decodes the config strictly).

=============================  ==================================  =========================
key                            value                               default
=============================  ==================================  =========================
``maxBytes``                   quantity (``1Gi``, ``500M``, 1000)  0: no global byte limit
``maxRequests``                quantity (``100``, ``1k``)          0: no global count limit
``defaultRequestTTL``          Go duration (``30s``, ``1m30s``)    0: no TTL (wait until
                                                                   dispatched or cancelled)
``defaultPriorityBand``        a band (below), template for        GIE's band defaults
                               priorities no band names
``enableEviction``             bool: evict sheddable in-flight     false
                               requests for blocked higher
                               bands (llm-d; eviction.py)
``priorityBands``              list of bands                       none
``usageLimitPolicyPluginRef``  a usage-limit policy plugin's name  static-usage-limit-policy
=============================  ==================================  =========================

``defaultNegativePriorityBand`` (llm-d-router v0.10.0): a band, the template for negative
priorities no band names (default: ``defaultPriorityBand``).

A band: ``priority`` (integer, higher is served first; 0 when omitted), ``maxBytes``
(quantity; 0 or omitted: 1,000,000,000), ``maxRequests`` (quantity; 0 or omitted: no
limit), ``fairnessPolicyRef`` (global-strict-fairness-policy), ``orderingPolicyRef``
(fcfs-ordering-policy). Two bands may not share a priority.

Phase 2, :func:`build_flow_control`: resolves the policy references against the config's
plugins → :class:`FlowControlConfig` (frozen, policies instantiated). A reference to one
of the three defaults that the config does not declare gets that plugin, built with its
defaults and added to the handle (GIE injects them under their type names).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from types import MappingProxyType
from typing import Any, Final

from epp.errors import ConfigError
from epp.flowcontrol.interfaces import (
    CAPABILITY_PRIORITY_CONFIGURABLE,
    QUEUE_HEAP,
    QUEUE_LIST,
    FairnessPolicy,
    OrderingPolicy,
    UsageLimitPolicy,
)
from epp.flowcontrol.plugins import (
    FCFSOrderingPolicy,
    GlobalStrictFairnessPolicy,
    StaticUsageLimitPolicy,
)
from epp.framework.handle import PluginHandle
from epp.framework.interfaces import Plugin
from epp.framework.params import suggest

#: The feature gate that turns flow control on (GIE's ``flowcontrol.FeatureGate``).
FEATURE_GATE: Final = "flowControl"
SECTION: Final = "flowControl"

# GIE's defaults (registry/config.go, controller/config.go).
DEFAULT_ORDERING_POLICY: Final = FCFSOrderingPolicy.type_name
DEFAULT_FAIRNESS_POLICY: Final = GlobalStrictFairnessPolicy.type_name
DEFAULT_USAGE_LIMIT_POLICY: Final = StaticUsageLimitPolicy.type_name
DEFAULT_BAND_MAX_BYTES: Final = 1_000_000_000
DEFAULT_FLOW_GC_TIMEOUT: Final = 300.0  # an idle flow's queue is dropped after 5 minutes
DEFAULT_PRIORITY_BAND_GC_TIMEOUT: Final = 600.0  # an idle dynamic band after 10

_TOP_KEYS: Final = frozenset({"maxBytes", "maxRequests", "defaultRequestTTL",
                              "defaultPriorityBand", "priorityBands",
                              "usageLimitPolicyPluginRef",
                              # llm-d-router v0.10.0 (apix/config/v1alpha1)
                              "defaultNegativePriorityBand", "enableEviction"})
_BAND_KEYS: Final = frozenset({"priority", "maxBytes", "maxRequests", "fairnessPolicyRef",
                               "orderingPolicyRef"})
_INT64_MAX: Final = (1 << 63) - 1

# ------------------------------------------------------------------------------ phase 1


@dataclass(frozen=True)
class PriorityBandSpec:
    """One ``priorityBands[i]`` entry (or ``defaultPriorityBand``), as written; None and 0
    mean "the default"."""

    priority: int = 0
    max_bytes: int | None = None
    max_requests: int | None = None
    fairness_policy_ref: str | None = None
    ordering_policy_ref: str | None = None
    path: str = ""


@dataclass(frozen=True)
class FlowControlSpec:
    """The ``flowControl`` section as written (GIE's ``FlowControlConfig``)."""

    max_bytes: int | None = None
    max_requests: int | None = None
    default_request_ttl: float | None = None  # seconds
    default_priority_band: PriorityBandSpec | None = None
    priority_bands: tuple[PriorityBandSpec, ...] = ()
    usage_limit_policy_ref: str | None = None
    path: str = SECTION
    warnings: tuple[str, ...] = ()
    # llm-d-router v0.10.0's keys.
    default_negative_priority_band: PriorityBandSpec | None = None
    enable_eviction: bool = False


def _err(source: str, path: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: {msg}")


def _check_keys(source: str, path: str, raw: Mapping[Any, Any],
                allowed: frozenset[str]) -> None:
    unknown = sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        hints = "".join(suggest(k, allowed) for k in unknown)
        raise _err(source, path, f"unknown key(s) {', '.join(map(repr, unknown))}{hints}; "
                   f"allowed: {', '.join(sorted(allowed))}")


_QUANTITY: Final = re.compile(
    r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_BINARY: Final = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50,
                  "Ei": 2 ** 60}
_DECIMAL: Final = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15,
                   "E": 18}


def parse_quantity(value: Any, path: str) -> int:
    """A Kubernetes resource quantity (``1Gi``, ``500M``, ``1k``, ``1e9``, or a number) as
    an integer, rounded up as ``Quantity.Value()`` rounds; must be >= 0. Raises
    ConfigError naming ``path``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{path}: expected a quantity such as 1000, '500M' or '1Gi', "
                          f"got {value!r}")
    if isinstance(value, int):
        number = Decimal(value)
    else:
        text = repr(value) if isinstance(value, float) else value.strip()
        m = _QUANTITY.match(text)
        if m is None:
            raise ConfigError(f"{path}: {value!r} is not a quantity; write a number of bytes "
                              "or requests (1000), or one with a suffix: decimal k, M, G, T "
                              "(1000s) or binary Ki, Mi, Gi, Ti (1024s)")
        try:
            number = Decimal(m.group(1))
        except InvalidOperation:  # the regex admits only decimal literals
            raise ConfigError(f"{path}: {value!r} is not a quantity") from None
        suffix = m.group(2) or ""
        if suffix in _BINARY:
            number *= _BINARY[suffix]
        elif suffix in _DECIMAL:
            number = number.scaleb(_DECIMAL[suffix])
        elif suffix:
            number = number.scaleb(int(suffix[1:]))
    if number < 0:
        raise ConfigError(f"{path}: must be non-negative, got {value!r}")
    result = math.ceil(number)
    if result > _INT64_MAX:
        raise ConfigError(f"{path}: {value!r} is too large (at most {_INT64_MAX})")
    return result


_DURATION_UNITS: Final = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3,
                          "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_go_duration(value: Any, path: str) -> float:
    """Seconds from a Go duration string (``time.ParseDuration``: ``30s``, ``1m30s``,
    ``1.5h``, ``300ms``, ``0``), which must not be negative. A bare number is refused as
    GIE's ``metav1.Duration`` refuses it."""
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a duration string such as '30s', '1m' or "
                          f"'1m30s', got {value!r}" + (" (quote it and add a unit)"
                                                        if isinstance(value, (int, float))
                                                        and not isinstance(value, bool)
                                                        else ""))
    text = value.strip()
    sign = 1.0
    if text[:1] in ("+", "-"):
        sign = -1.0 if text[0] == "-" else 1.0
        text = text[1:]
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if m is None:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if not text or pos != len(text):
        raise ConfigError(f"{path}: {value!r} is not a duration; write a number with a unit "
                          "(ns, us, ms, s, m, h), e.g. '30s' or '1m30s'")
    if sign < 0 and total > 0:
        raise ConfigError(f"{path}: cannot be negative, got {value!r}; use '0' (or leave it "
                          "out) for no TTL")
    return total


def _ref(source: str, path: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _err(source, path, f"expected a plugin name, got {value!r}")
    return value


def _quantity(source: str, path: str, value: Any) -> int | None:
    if value is None:
        return None
    try:
        return parse_quantity(value, path)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _band(source: str, path: str, raw: Any, template: bool) -> tuple[PriorityBandSpec, list[str]]:
    if not isinstance(raw, Mapping):
        raise _err(source, path, f"expected a mapping (priority, maxBytes, maxRequests, "
                   f"fairnessPolicyRef, orderingPolicyRef), got {type(raw).__name__}")
    _check_keys(source, path, raw, _BAND_KEYS)
    warnings: list[str] = []
    priority = raw.get("priority")
    if priority is None:
        priority = 0  # GIE: the field's zero value
    elif isinstance(priority, bool) or not isinstance(priority, int):
        raise _err(source, f"{path}.priority", f"expected an integer (higher is served "
                   f"first; negative = sheddable), got {priority!r}")
    elif template:
        warnings.append(f"{path}.priority: ignored; the default band is the template for "
                        "every priority no band names")
    return PriorityBandSpec(
        priority=priority,
        max_bytes=_quantity(source, f"{path}.maxBytes", raw.get("maxBytes")),
        max_requests=_quantity(source, f"{path}.maxRequests", raw.get("maxRequests")),
        fairness_policy_ref=_ref(source, f"{path}.fairnessPolicyRef",
                                 raw.get("fairnessPolicyRef")),
        ordering_policy_ref=_ref(source, f"{path}.orderingPolicyRef",
                                 raw.get("orderingPolicyRef")),
        path=path,
    ), warnings


def parse_flow_control(raw: Any, source: str = "<config>",
                       path: str = SECTION) -> FlowControlSpec:
    """Phase 1: the ``flowControl`` mapping (``None``: an empty section) → a
    :class:`FlowControlSpec`. Raises ConfigError as ``"<source>: <path>: <problem and
    fix>"``."""
    if raw is None:
        return FlowControlSpec(path=path)
    if not isinstance(raw, Mapping):
        raise _err(source, path, f"expected a mapping, got {type(raw).__name__}")
    _check_keys(source, path, raw, _TOP_KEYS)
    warnings: list[str] = []
    ttl: float | None = None
    if raw.get("defaultRequestTTL") is not None:
        try:
            ttl = parse_go_duration(raw["defaultRequestTTL"], f"{path}.defaultRequestTTL")
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    default_band: PriorityBandSpec | None = None
    if raw.get("defaultPriorityBand") is not None:
        default_band, w = _band(source, f"{path}.defaultPriorityBand",
                                raw["defaultPriorityBand"], template=True)
        warnings += w
    negative_band: PriorityBandSpec | None = None
    if raw.get("defaultNegativePriorityBand") is not None:
        negative_band, w = _band(source, f"{path}.defaultNegativePriorityBand",
                                 raw["defaultNegativePriorityBand"], template=True)
        warnings += w
    eviction = raw.get("enableEviction")
    if eviction is not None and not isinstance(eviction, bool):
        raise _err(source, f"{path}.enableEviction",
                   f"expected true or false, got {eviction!r}")
    bands: list[PriorityBandSpec] = []
    raw_bands = raw.get("priorityBands")
    if raw_bands is not None:
        if not isinstance(raw_bands, list):
            raise _err(source, f"{path}.priorityBands",
                       f"expected a list of bands, got {type(raw_bands).__name__}")
        seen: dict[int, str] = {}
        for i, entry in enumerate(raw_bands):
            band, w = _band(source, f"{path}.priorityBands[{i}]", entry, template=False)
            warnings += w
            if band.priority in seen:
                raise _err(source, f"{band.path}.priority",
                           f"duplicate priority level {band.priority} (also at "
                           f"{seen[band.priority]}); give each band its own priority")
            seen[band.priority] = band.path
            bands.append(band)
    return FlowControlSpec(
        max_bytes=_quantity(source, f"{path}.maxBytes", raw.get("maxBytes")),
        max_requests=_quantity(source, f"{path}.maxRequests", raw.get("maxRequests")),
        default_request_ttl=ttl,
        default_priority_band=default_band,
        priority_bands=tuple(bands),
        usage_limit_policy_ref=_ref(source, f"{path}.usageLimitPolicyPluginRef",
                                    raw.get("usageLimitPolicyPluginRef")),
        path=path,
        warnings=tuple(warnings),
        default_negative_priority_band=negative_band,
        enable_eviction=bool(eviction),
    )


# ------------------------------------------------------------------------------ phase 2


@dataclass(frozen=True)
class BandConfig:
    """A priority band with its defaults applied and policies resolved (GIE's
    registry ``PriorityBandConfig``). ``max_requests`` 0: no count limit. ``queue``:
    :data:`~epp.flowcontrol.interfaces.QUEUE_LIST` or ``QUEUE_HEAP``, from what the
    ordering policy needs."""

    priority: int
    fairness_policy: FairnessPolicy
    ordering_policy: OrderingPolicy
    max_bytes: int = DEFAULT_BAND_MAX_BYTES
    max_requests: int = 0
    queue: str = QUEUE_LIST

    def for_priority(self, priority: int) -> BandConfig:
        """This band (a template) for another priority level."""
        return BandConfig(priority, self.fairness_policy, self.ordering_policy,
                          self.max_bytes, self.max_requests, self.queue)


def band_config(priority: int, fairness: FairnessPolicy, ordering: OrderingPolicy,
                max_bytes: int | None = None, max_requests: int | None = None) -> BandConfig:
    """A :class:`BandConfig` with GIE's defaults: ``max_bytes`` None/0 → 1 GB,
    ``max_requests`` None → 0 (no limit), the queue from the ordering policy."""
    queue = (QUEUE_HEAP if CAPABILITY_PRIORITY_CONFIGURABLE
             in ordering.required_queue_capabilities else QUEUE_LIST)
    return BandConfig(priority, fairness, ordering, max_bytes or DEFAULT_BAND_MAX_BYTES,
                      max_requests or 0, queue)


def _no_bands() -> Mapping[int, BandConfig]:
    return MappingProxyType({})


@dataclass(frozen=True)
class FlowControlConfig:
    """Flow control, ready to run (GIE's ``flowcontrol.Config``: controller + registry +
    usage-limit policy). ``max_bytes`` / ``max_requests`` 0: no global limit;
    ``default_request_ttl`` 0: none. ``default_priority_band`` is the template for any
    priority not in ``priority_bands``; such bands are created on first use and dropped
    after ``priority_band_gc_timeout`` idle seconds, an idle flow's queue after
    ``flow_gc_timeout`` (GIE's internal defaults; not config keys)."""

    default_priority_band: BandConfig
    usage_limit_policy: UsageLimitPolicy
    priority_bands: Mapping[int, BandConfig] = field(default_factory=_no_bands)
    max_bytes: int = 0
    max_requests: int = 0
    default_request_ttl: float = 0.0
    flow_gc_timeout: float = DEFAULT_FLOW_GC_TIMEOUT
    priority_band_gc_timeout: float = DEFAULT_PRIORITY_BAND_GC_TIMEOUT
    # llm-d-router v0.10.0: the template for negative priorities no band names (None:
    # ``default_priority_band``), and in-flight eviction (epp/flowcontrol/eviction.py).
    default_negative_priority_band: BandConfig | None = None
    enable_eviction: bool = False

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.max_requests < 0:
            raise ValueError("max_bytes and max_requests must be >= 0")
        if self.default_request_ttl < 0:
            raise ValueError(f"default_request_ttl cannot be negative, got "
                             f"{self.default_request_ttl}")
        if not self.flow_gc_timeout > 0:
            raise ValueError("flow_gc_timeout must be positive")
        if self.priority_band_gc_timeout < self.flow_gc_timeout:
            raise ValueError("priority_band_gc_timeout must be >= flow_gc_timeout")
        for priority, band in self.priority_bands.items():
            if band.priority != priority:
                raise ValueError(f"priority_bands[{priority}] holds the band of priority "
                                 f"{band.priority}")

    def band(self, priority: int) -> BandConfig:
        """The configured band for ``priority``, or the default template for it."""
        band = self.priority_bands.get(priority)
        return band if band is not None else self.template_for(priority)

    def template_for(self, priority: int) -> BandConfig:
        """The template a band for ``priority`` is provisioned from: the negative-priority
        template for priority < 0 when there is one (llm-d's registry), else the default."""
        template = self.default_priority_band
        if priority < 0 and self.default_negative_priority_band is not None:
            template = self.default_negative_priority_band
        return template.for_priority(priority)


def default_config(*, max_bytes: int = 0, max_requests: int = 0,
                   default_request_ttl: float = 0.0,
                   bands: Mapping[int, tuple[FairnessPolicy | None, OrderingPolicy | None]]
                   | None = None,
                   band_max_bytes: int | None = None, band_max_requests: int | None = None,
                   usage_limit: UsageLimitPolicy | None = None) -> FlowControlConfig:
    """A config without a file: GIE's default policies (fresh instances) unless given;
    ``bands`` maps a priority to (fairness, ordering) policies (None: the default);
    ``band_max_*`` apply to every band, the default template included (tests, benchmarks,
    the Python API)."""
    fairness: FairnessPolicy = GlobalStrictFairnessPolicy()
    ordering: OrderingPolicy = FCFSOrderingPolicy()
    configured = {p: band_config(p, f or fairness, o or ordering, band_max_bytes,
                                 band_max_requests)
                  for p, (f, o) in (bands or {}).items()}
    return FlowControlConfig(
        default_priority_band=band_config(0, fairness, ordering, band_max_bytes,
                                          band_max_requests),
        usage_limit_policy=usage_limit or StaticUsageLimitPolicy(),
        priority_bands=MappingProxyType(configured),
        max_bytes=max_bytes, max_requests=max_requests,
        default_request_ttl=default_request_ttl)


_DEFAULT_BUILDERS: Final[Mapping[str, type]] = {
    DEFAULT_ORDERING_POLICY: FCFSOrderingPolicy,
    DEFAULT_FAIRNESS_POLICY: GlobalStrictFairnessPolicy,
    DEFAULT_USAGE_LIMIT_POLICY: StaticUsageLimitPolicy,
}
_KIND_HELP: Final = {
    OrderingPolicy: ("an ordering policy",
                     "fcfs-ordering-policy, edf-ordering-policy or slo-deadline-ordering-policy"),
    FairnessPolicy: ("a fairness policy",
                     "global-strict-fairness-policy or round-robin-fairness-policy"),
    UsageLimitPolicy: ("a usage limit policy", "static-usage-limit-policy"),
}


def _resolve(handle: PluginHandle, source: str, path: str, ref: str,
             kind: type[Any]) -> Any:
    what, types_ = _KIND_HELP[kind]
    plugin: Plugin | None = handle.get(ref)
    if plugin is None and ref in _DEFAULT_BUILDERS:
        plugin = _DEFAULT_BUILDERS[ref](ref)  # GIE's registerDefaultPlugin: name = type
        handle.add(plugin)
    if plugin is None:
        declared = ", ".join(sorted(handle.plugins)) or "none"
        raise _err(source, path, f"no plugin named {ref!r} in 'plugins'"
                   f"{suggest(ref, [*handle.plugins, *_DEFAULT_BUILDERS])} ({what}: declare "
                   f"one of type {types_}); "
                   f"declared: {declared}")
    if not isinstance(plugin, kind):
        raise _err(source, path, f"{ref!r} ({plugin.type_name}) is not {what}; use a plugin "
                   f"of type {types_}")
    return plugin


def _build_band(handle: PluginHandle, source: str, spec: PriorityBandSpec | None,
                priority: int, path: str) -> BandConfig:
    fref = (spec.fairness_policy_ref if spec else None) or DEFAULT_FAIRNESS_POLICY
    oref = (spec.ordering_policy_ref if spec else None) or DEFAULT_ORDERING_POLICY
    fpath = f"{path}.fairnessPolicyRef" if spec and spec.fairness_policy_ref else path
    opath = f"{path}.orderingPolicyRef" if spec and spec.ordering_policy_ref else path
    ordering = _resolve(handle, source, opath, oref, OrderingPolicy)
    fairness = _resolve(handle, source, fpath, fref, FairnessPolicy)
    return band_config(priority, fairness, ordering, spec.max_bytes if spec else None,
                       spec.max_requests if spec else None)


def build_flow_control(spec: FlowControlSpec | None, handle: PluginHandle,
                       source: str = "<config>") -> FlowControlConfig:
    """Phase 2: resolve the policy references of ``spec`` (None: no ``flowControl``
    section) against the config's plugins. Default policies the config does not declare
    are built and added to ``handle`` under their type names. Raises ConfigError naming
    the key (``flowControl.priorityBands[0].orderingPolicyRef``) and the fix."""
    if spec is None:
        spec = FlowControlSpec()
    template_path = (spec.default_priority_band.path if spec.default_priority_band
                     else f"{spec.path}.defaultPriorityBand")
    template = _build_band(handle, source, spec.default_priority_band, 0, template_path)
    negative: BandConfig | None = None
    if spec.default_negative_priority_band is not None:
        negative = _build_band(handle, source, spec.default_negative_priority_band, 0,
                               spec.default_negative_priority_band.path)
    bands = {b.priority: _build_band(handle, source, b, b.priority, b.path)
             for b in spec.priority_bands}
    uref = spec.usage_limit_policy_ref or DEFAULT_USAGE_LIMIT_POLICY
    upath = (f"{spec.path}.usageLimitPolicyPluginRef" if spec.usage_limit_policy_ref
             else spec.path)
    usage = _resolve(handle, source, upath, uref, UsageLimitPolicy)
    return FlowControlConfig(
        default_priority_band=template,
        usage_limit_policy=usage,
        priority_bands=MappingProxyType(bands),
        max_bytes=spec.max_bytes or 0,
        max_requests=spec.max_requests or 0,
        default_request_ttl=spec.default_request_ttl or 0.0,
        default_negative_priority_band=negative,
        enable_eviction=spec.enable_eviction,
    )
