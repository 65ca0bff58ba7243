"""``disaggregatedset-rollout-screener`` (llm-d-router): keep a request's prefill and
decode on one revision of a rolling DisaggregatedSet.

llm-d-router v0.10.0 ``pkg/epp/framework/plugins/requestcontrol/screener/
disaggregatedsetrollout`` (``config.go``, ``plugin.go``, ``screener.go``, README). A
:class:`~epp.framework.interfaces.Screener` (runs once per request, before the PrepareData
plugins and every scheduling profile) and a ResponseHeaders plugin.

Revision gating (``revisionGating.mode`` ``sum`` or ``max-role``, with
``requireRoles.values``): the screener counts the Ready pods matching
``scope.labelSelector`` per revision (label ``revisionLabelKey``, default
``disaggregatedset.x-k8s.io/revision``) and role (``roleLabelKey``, default
``disaggregatedset.x-k8s.io/role``), from Pod notifications its pod extractor receives.
A revision is *covered* when every required role has a Ready pod; its weight is the sum
of those pods (``sum``) or its pods of the role with the most pods over all covered
revisions (``max-role``; ties: the first listed role). Per request, candidates of
uncovered revisions are dropped and, unless a strict header selector pins the revision,
one revision is drawn by weight and only its candidates stay (so the prefill and decode
profiles cannot pick different revisions). No covered revision: 503 (also until the
first Pod notifications arrive). ``mode: disabled`` turns this off.

Header selectors (``headerSelectors``: ``name``, ``headerName``, ``labelKey``, ``mode``
``strict`` or ``prefer``): a ``strict`` selector whose header the request carries keeps
only candidates whose label equals it (none: 503, never another value); ``prefer`` only
stamps (score it with ``header-label-affinity-scorer``). Every selector's header is set on
the response to the label value of the endpoint the request went to.

Pods: the screener's pod extractor (type ``disaggregatedset-rollout-pod-extractor``, name
``<screener name>/pod``), added to the config by the screener when gating is on, reads
``k8s-notification-source`` Pod events. llm-d's framework attaches it to a Pod source by
itself; here the config's ``dataLayer.sources`` lists a ``k8s-notification-source`` for
``/v1 Pod`` with that extractor (docs/plugins.md).
"""

from __future__ import annotations

import bisect
import logging
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from epp.errors import ConfigError
from epp.framework import interfaces as fw
from epp.framework.handle import PluginHandle
from epp.framework.params import param
from epp.scheduling.plugins.filters import LabelSelector, Operator, Requirement
from epp.scheduling.types import Endpoint, LLMRequest, SchedulingResult

if TYPE_CHECKING:
    from epp.observability.metrics import EppMetrics

log = logging.getLogger(__name__)

PLUGIN_TYPE: Final = "disaggregatedset-rollout-screener"
POD_EXTRACTOR_TYPE: Final = "disaggregatedset-rollout-pod-extractor"
DEFAULT_REVISION_LABEL: Final = "disaggregatedset.x-k8s.io/revision"
DEFAULT_ROLE_LABEL: Final = "disaggregatedset.x-k8s.io/role"
MODE_STRICT: Final = "strict"
MODE_PREFER: Final = "prefer"
GATING_SUM: Final = "sum"
GATING_MAX_ROLE: Final = "max-role"
GATING_DISABLED: Final = "disabled"
POD_GVK: Final = fw.gvk_string("", "v1", "Pod")

# ----------------------------------------------------------- Kubernetes selector strings

_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?"
_EQ = re.compile(rf"^\s*({_NAME})\s*(==|=|!=)\s*({_NAME})?\s*$")
_SET = re.compile(rf"^\s*({_NAME})\s+(in|notin)\s*\(([^)]*)\)\s*$")
_EXISTS = re.compile(rf"^\s*(!?)\s*({_NAME})\s*$")


def parse_selector_string(text: str) -> LabelSelector:
    """Kubernetes' label selector string (``labels.Parse``): comma-separated ``k=v``,
    ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k``, ``!k``. Raises
    ValueError naming the bad part."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    reqs: list[Requirement] = []
    for part in parts:
        if not part.strip():
            if len(parts) == 1:
                continue
            raise ValueError(f"empty requirement in {text!r}")
        if m := _SET.match(part):
            values = [v.strip() for v in m.group(3).split(",")]
            if not all(values):
                raise ValueError(f"{part.strip()!r}: empty value in the set")
            op = Operator.IN if m.group(2) == "in" else Operator.NOT_IN
            reqs.append(Requirement(m.group(1), op, frozenset(values)))
        elif m := _EQ.match(part):
            value = m.group(3) or ""
            op = Operator.NOT_IN if m.group(2) == "!=" else Operator.IN
            reqs.append(Requirement(m.group(1), op, frozenset({value})))
        elif m := _EXISTS.match(part):
            op = Operator.DOES_NOT_EXIST if m.group(1) else Operator.EXISTS
            reqs.append(Requirement(m.group(2), op))
        else:
            raise ValueError(f"{part.strip()!r} is not a label requirement (k=v, k!=v, "
                             "k in (a,b), k notin (a,b), k, !k)")
    return LabelSelector(tuple(reqs))


# -------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class HeaderSelector:
    name: str
    header_name: str  # lower-cased
    label_key: str
    mode: str


@dataclass(frozen=True)
class RevisionGating:
    mode: str
    require_roles: tuple[str, ...] | None  # None: no requireRoles block
    revision_label_key: str = DEFAULT_REVISION_LABEL
    role_label_key: str = DEFAULT_ROLE_LABEL

    @property
    def active(self) -> bool:
        return self.mode in (GATING_SUM, GATING_MAX_ROLE) and self.require_roles is not None


def _mapping(v: Any, path: str, keys: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(keys)}, got {v!r}")
    unknown = sorted(set(v) - set(keys))
    if unknown:  # llm-d decodes these strictly (DisallowUnknownFields)
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: "
                          f"{', '.join(keys)}")
    return v


def _string(raw: Mapping[str, Any], key: str, path: str) -> str:
    v = raw.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ConfigError(f"{path}.{key}: expected a string, got {v!r}")
    return v


def _scope(v: Any, path: str) -> str:
    return _string(_mapping(v, path, ("labelSelector",)), "labelSelector", path)


def _header_selectors(v: Any, path: str) -> tuple[HeaderSelector, ...]:
    if not isinstance(v, list):
        raise ConfigError(f"{path}: expected a list of {{name, headerName, labelKey, mode}}")
    out = []
    for i, raw in enumerate(v):
        p = f"{path}[{i}]"
        m = _mapping(raw, p, ("name", "headerName", "labelKey", "mode"))
        out.append(HeaderSelector(_string(m, "name", p), _string(m, "headerName", p).lower(),
                                  _string(m, "labelKey", p), _string(m, "mode", p)))
    return tuple(out)


def _gating(v: Any, path: str) -> RevisionGating:
    m = _mapping(v, path, ("mode", "requireRoles", "revisionLabelKey", "roleLabelKey"))
    roles: tuple[str, ...] | None = None
    if m.get("requireRoles") is not None:
        rr = _mapping(m["requireRoles"], f"{path}.requireRoles", ("values",))
        values = rr.get("values") or []
        if not isinstance(values, list) or not all(isinstance(r, str) for r in values):
            raise ConfigError(f"{path}.requireRoles.values: expected a list of role names")
        roles = tuple(values)
    return RevisionGating(_string(m, "mode", path), roles,
                          _string(m, "revisionLabelKey", path) or DEFAULT_REVISION_LABEL,
                          _string(m, "roleLabelKey", path) or DEFAULT_ROLE_LABEL)


@dataclass(frozen=True)
class RolloutScreenerParameters:
    scope_label_selector: str = param("scope", "", parse=_scope)
    header_selectors: tuple[HeaderSelector, ...] = param(
        "headerSelectors", (), parse=_header_selectors)
    revision_gating: RevisionGating | None = param(  # noqa: RUF009 -- param() is the framework's field(); frozen default
        "revisionGating", None, parse=_gating)


def validate(p: RolloutScreenerParameters) -> tuple[LabelSelector, RevisionGating]:
    """llm-d's ``Config.Validate``, with its messages; ConfigError."""
    if not p.scope_label_selector:
        raise ConfigError("scope.labelSelector is required")
    try:
        scope = parse_selector_string(p.scope_label_selector)
    except ValueError as e:
        raise ConfigError(f"scope.labelSelector is not a valid label selector: {e}") from None
    names: set[str] = set()
    headers: set[str] = set()
    for i, s in enumerate(p.header_selectors):
        for key, value in (("name", s.name), ("headerName", s.header_name),
                           ("labelKey", s.label_key)):
            if not value:
                raise ConfigError(f"headerSelectors[{i}].{key} is required")
        if s.mode not in (MODE_STRICT, MODE_PREFER):
            raise ConfigError(f"headerSelectors[{i}].mode {s.mode!r} must be one of "
                              "strict|prefer")
        if s.name in names:
            raise ConfigError(f"headerSelectors: duplicate name {s.name!r}")
        names.add(s.name)
        if s.header_name in headers:
            raise ConfigError(f"headerSelectors: duplicate headerName {s.header_name!r}")
        headers.add(s.header_name)
    g = p.revision_gating
    if g is None:
        raise ConfigError("revisionGating is required")
    if g.mode in (GATING_SUM, GATING_MAX_ROLE):
        if g.require_roles is None:
            raise ConfigError(f"revisionGating.requireRoles is required when "
                              f"revisionGating.mode={g.mode}")
        if not g.require_roles:
            raise ConfigError("revisionGating.requireRoles.values must contain at least "
                              "one role")
        seen: set[str] = set()
        for i, role in enumerate(g.require_roles):
            if not role:
                raise ConfigError(f"revisionGating.requireRoles.values[{i}] must not be empty")
            if role in seen:
                raise ConfigError("revisionGating.requireRoles.values contains duplicate "
                                  f"role {role!r}")
            seen.add(role)
    elif g.mode != GATING_DISABLED:
        raise ConfigError(f"revisionGating.mode {g.mode!r} must be one of "
                          "sum|max-role|disabled")
    return scope, g


# ------------------------------------------------------------------------ distribution


def revision_shares(role_counts: Mapping[str, Mapping[str, int]], required: Sequence[str],
                    mode: str) -> dict[str, float]:
    """Each covered revision's share of traffic (see the module doc); uncovered: absent."""
    covered = {rev: per for rev, per in role_counts.items()
               if required and all(per.get(r, 0) > 0 for r in required)}
    if mode == GATING_MAX_ROLE:
        dominant, best = "", -1
        for role in required:
            total = sum(per.get(role, 0) for per in covered.values())
            if total > best:
                dominant, best = role, total
        weights = {rev: per.get(dominant, 0) for rev, per in covered.items()}
    else:
        weights = {rev: sum(per.get(r, 0) for r in required) for rev, per in covered.items()}
    total = sum(weights.values())
    return {rev: w / total for rev, w in weights.items()} if total > 0 else {}


def pick_weighted_revision(shares: Mapping[str, float], draw: float) -> str:
    """llm-d's ``pickWeightedRevision``: revisions sorted by name, ``draw`` in [0, 1)."""
    revisions = sorted(shares)
    total = sum(shares.values())
    if total == 0:
        return ""
    if len(revisions) == 1:
        return revisions[0]
    cumulative = []
    acc = 0.0
    for r in revisions:
        acc += shares[r]
        cumulative.append(acc)
    i = bisect.bisect_right(cumulative, draw * total)
    return revisions[min(i, len(revisions) - 1)]


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """llm-d's ``IsPodReady``: not being deleted, condition Ready True."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for c in (pod.get("status") or {}).get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


class RolloutPodExtractor:
    """The screener's Pod notification extractor (``<screener>/pod``)."""

    type_name = POD_EXTRACTOR_TYPE
    data_input = fw.DATA_K8S_NOTIFICATIONS

    def __init__(self, screener: DisaggregatedSetRolloutScreener) -> None:
        self.name = f"{screener.name}/pod"
        self.screener = screener

    @property
    def gvk(self) -> str:
        return POD_GVK

    def extract_notification(self, event: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        s = self.screener
        if event == fw.EVENT_DELETE or not s.accepts_pod(obj):
            s.remove_pod(key)
            return
        labels = meta.get("labels") or {}
        s.set_pod(key, labels[s.gating.revision_label_key], labels[s.gating.role_label_key])


# ----------------------------------------------------------------------------- plugin


class DisaggregatedSetRolloutScreener:
    type_name = PLUGIN_TYPE
    Parameters = RolloutScreenerParameters

    def __init__(self, name: str, scope: LabelSelector, gating: RevisionGating,
                 selectors: Sequence[HeaderSelector] = (),
                 rng: Callable[[], float] = random.random) -> None:
        self.name = name
        self.scope = scope
        self.gating = gating
        self.selectors = tuple(selectors)
        self.rng = rng
        self.pods: dict[tuple[str, str], tuple[str, str]] = {}  # (ns, name) -> (rev, role)
        self.role_counts: dict[str, dict[str, int]] = {}
        # Each covered revision's share, and strict selections that matched nothing (per
        # selector); exported as llm-d's llm_d_epp_disaggregatedset_revision_gating_share
        # and ..._strict_header_no_match_total when bound to metrics (bind_metrics).
        self.shares: dict[str, float] = {}
        self.strict_no_match: dict[str, int] = {}
        self._metrics: EppMetrics | None = None
        self.pod_extractor = RolloutPodExtractor(self)
        self._state_key = f"{PLUGIN_TYPE}/{name}"

    @classmethod
    def from_params(cls, name: str, params: RolloutScreenerParameters,
                    handle: PluginHandle) -> DisaggregatedSetRolloutScreener:
        try:
            scope, gating = validate(params)
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}") from None
        return cls(name, scope, gating, params.header_selectors)

    def bind_metrics(self, metrics: EppMetrics) -> None:
        """Record llm-d's two rollout series (disaggregatedsetrollout/metrics.go)."""
        self._metrics = metrics

    def bind(self, handle: PluginHandle) -> None:
        """Gating on: add the pod extractor (``<name>/pod``) for the data layer."""
        if self.gating.active and handle.get(self.pod_extractor.name) is None:
            handle.add(self.pod_extractor)

    # --- pods ---

    def accepts_pod(self, pod: Mapping[str, Any]) -> bool:
        if not self.gating.active:
            return False
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if not self.scope.matches(labels) or not pod_ready(pod):
            return False
        return bool(labels.get(self.gating.revision_label_key)) and bool(
            labels.get(self.gating.role_label_key))

    def set_pod(self, key: tuple[str, str], revision: str, role: str) -> None:
        self.pods[key] = (revision, role)
        self._rebuild()

    def remove_pod(self, key: tuple[str, str]) -> None:
        if self.pods.pop(key, None) is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        counts: dict[str, dict[str, int]] = {}
        for revision, role in self.pods.values():
            per = counts.setdefault(revision, {})
            per[role] = per.get(role, 0) + 1
        previous = self.role_counts
        self.role_counts = counts
        self.shares = revision_shares(counts, self.gating.require_roles or (),
                                      self.gating.mode)
        if self._metrics is not None:
            # llm-d's recordRevisionGatingShares: every observed revision (an incomplete
            # one at 0); a revision no longer observed loses its series.
            self._metrics.record_revision_gating_shares(
                self, self.gating.mode, {r: self.shares.get(r, 0.0) for r in counts},
                previous)

    # --- per request ---

    def _has_strict_header(self, request: LLMRequest) -> bool:
        return any(s.mode == MODE_STRICT and request.headers.get(s.header_name)
                   for s in self.selectors)

    def screen(self, request: LLMRequest, endpoints: Sequence[Endpoint]) -> Sequence[Endpoint]:
        current: Sequence[Endpoint] = endpoints
        if self.gating.active:
            rev_key = self.gating.revision_label_key
            seen = {e.labels.get(rev_key, "") for e in current} - {""}
            shares = {r: self.shares[r] for r in seen if self.shares.get(r, 0.0) > 0}
            chosen = ("" if self._has_strict_header(request)
                      else pick_weighted_revision(shares, self.rng()))
            current = [e for e in current if e.labels.get(rev_key, "") in shares
                       and (not chosen or e.labels.get(rev_key) == chosen)]
            if not current:
                return []
        if not current:  # llm-d's screenStrictSelectors: nothing to select from
            return current
        for s in self.selectors:
            if s.mode != MODE_STRICT:
                continue
            wanted = request.headers.get(s.header_name)
            if not wanted:
                continue
            current = [e for e in current if e.labels.get(s.label_key) == wanted]
            if not current:
                self.strict_no_match[s.name] = self.strict_no_match.get(s.name, 0) + 1
                if self._metrics is not None:
                    self._metrics.record_strict_header_no_match(self, s.name)
                return []
        return current

    def pre_request(self, request: LLMRequest, result: SchedulingResult) -> None:
        primary = result.profile_results.get(result.primary_profile)
        if primary is not None and primary.endpoints:
            labels = primary.endpoints[0].labels
            request.plugin_state[self._state_key] = {
                s.header_name: labels[s.label_key] for s in self.selectors
                if labels.get(s.label_key)}

    def response_headers(self, request: LLMRequest, endpoint_key: str, status: int,
                         headers: Mapping[str, str]) -> Mapping[str, str] | None:
        stamped = request.plugin_state.get(self._state_key)
        return dict(stamped) if stamped else None
