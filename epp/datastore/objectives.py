"""InferenceObjectives and InferenceModelRewrites: the objects, and the store the request
path reads them from.

The two API objects of GIE v1.5.0 the EPP reads besides the pool and its pods
(``inference.networking.x-k8s.io/v1alpha2``, GIE's apix/v1alpha2 and its CRDs under
config/crd/bases):

- an **InferenceObjective** gives a name a ``priority`` (``spec.priority``, an integer,
  negative allowed, optional). A request names its objective in the
  ``x-gateway-inference-objective`` header; its priority is that objective's, or 0 — GIE's
  default — when the header is absent, names no known objective, or the objective has no
  priority (GIE's ``Director.getInferenceObjective``).
- an **InferenceModelRewrite** has ordered ``rules``; a rule ``matches`` the model the
  client asked for (the body's ``model``; ``matches[].model`` with ``type: Exact``, the
  only type) or, with no ``matches``, every model, and sends the request to one of its
  ``targets`` (``modelRewrite``), chosen at random by ``weight``.

Rule precedence, across every rewrite of the pool (GIE's modelRewriteStore): a rule with an
exact match for the model wins over a generic one (no ``matches``); among those, the rule
of the oldest rewrite (``metadata.creationTimestamp``) wins; within one rewrite, the first
rule in list order. Ties between rewrites created in the same second (timestamps have
one-second resolution; GIE's sort leaves their order unspecified) go to the one with the
lower ``order`` (its position in an objectives file), then to the name that sorts first.

Weighted choice (GIE's ``Director.selectWeightedModel``): a target gets ``weight / sum of
weights`` of the requests; a target without a weight counts 0; when no target of the rule
has a weight, each gets an equal share. A winning rule without targets leaves the model
as it is (GIE would send the request on with an empty model name).

:class:`ObjectiveStore` is filled by Kubernetes discovery (epp/discovery/kubernetes.py) or
the objectives file (epp/discovery/objectives_file.py) and read by the Director
(epp/requestcontrol/director.py). Lookups are O(1): the winning rule of every exact model
and the winning generic rule are worked out whenever the rewrites change. With
``--workers N`` the scheduling core sends the store's content to each front process
(:meth:`ObjectiveStore.export`, :meth:`ObjectiveStore.load`).

:func:`parse_object` turns a Kubernetes object (a decoded JSON/YAML mapping) into an
:class:`Objective` or :class:`ModelRewrite`, with the CRD's defaults; ``strict`` (the
objectives file) also refuses fields the CRD does not have.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from epp import keys

log = logging.getLogger(__name__)

DEFAULT_PRIORITY = 0  # GIE's Director.defaultPriority: no objective, or none set
MATCH_EXACT = "Exact"  # ModelMatch.type: the only value (and the default)
MAX_WEIGHT = 1_000_000  # TargetModel.weight: 1..1000000 (the CRD's bounds)

_GROUP = re.compile(r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")

Listener = Callable[[], None]


class InvalidObject(ValueError):
    """An object this EPP cannot use; the message names the field and the problem."""


# ---------------------------------------------------------------------------- the values
@dataclass(frozen=True, slots=True)
class PoolRef:
    """``spec.poolRef``, with the CRD's defaults for ``group`` and ``kind``."""

    name: str
    group: str = keys.K8S_POOL_GROUP
    kind: str = keys.K8S_POOL_KIND


@dataclass(frozen=True, slots=True)
class Objective:
    """An InferenceObjective: ``priority`` None when the object sets none (counts as 0)."""

    name: str
    priority: int | None = None
    pool_ref: PoolRef | None = None

    @property
    def effective_priority(self) -> int:
        return DEFAULT_PRIORITY if self.priority is None else self.priority


@dataclass(frozen=True, slots=True)
class TargetModel:
    """One ``targets[]`` entry; ``weight`` 0 when not set."""

    model_rewrite: str
    weight: int = 0


@dataclass(frozen=True, slots=True)
class RewriteRule:
    """One ``rules[]`` entry. ``models``: the exact model names it matches; a rule whose
    ``matches`` is empty or absent is ``generic`` (matches every model)."""

    models: tuple[str, ...] = ()
    targets: tuple[TargetModel, ...] = ()
    generic: bool = False


@dataclass(frozen=True, slots=True)
class ModelRewrite:
    """An InferenceModelRewrite. ``created``: ``metadata.creationTimestamp`` in seconds
    since the epoch (0 when absent); ``order``: its position in an objectives file (0 for
    Kubernetes objects): both order precedence, see the module doc."""

    name: str
    rules: tuple[RewriteRule, ...] = ()
    created: float = 0.0
    order: int = 0
    pool_ref: PoolRef | None = None


# ---------------------------------------------------------------------------- the store
class ObjectiveStore:
    """The objectives and model rewrites of one pool, by name (one namespace: GIE keys its
    datastore by name alone).

    Writers replace one object (:meth:`set_objective`, :meth:`set_rewrite`, the deletes)
    or a whole kind (:meth:`replace_objectives`, :meth:`replace_rewrites`); listeners
    (:meth:`on_change`) hear about every write that changed something, synchronously, and
    must not raise (a raising listener is logged and skipped). Single-threaded (the
    event loop), like the rest of the datastore.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self._objectives: dict[str, Objective] = {}
        self._rewrites: dict[str, ModelRewrite] = {}
        self._exact: dict[str, tuple[RewriteRule, str]] = {}
        self._generic: tuple[RewriteRule, str] | None = None
        self._listeners: list[Listener] = []
        self._rng = rng or random.Random()
        self.version = 0  # bumped on every change (tests, observability)

    # -- reads (the request path) ---------------------------------------------------
    def objective(self, name: str | None) -> Objective | None:
        return self._objectives.get(name) if name else None

    def priority(self, name: str | None) -> int:
        """The priority of the objective ``name``; 0 (GIE's default) when ``name`` is None
        or empty, names no objective, or the objective sets no priority."""
        obj = self._objectives.get(name) if name else None
        return DEFAULT_PRIORITY if obj is None or obj.priority is None else obj.priority

    def rule_for(self, model: str) -> tuple[RewriteRule, str] | None:
        """The winning rule for ``model`` and the name of its InferenceModelRewrite
        (GIE's ``ModelRewriteGet``); None when no rule matches."""
        hit = self._exact.get(model)
        return hit if hit is not None else self._generic

    def choose_target(self, rule: RewriteRule) -> str | None:
        """One of ``rule``'s targets, by weight (GIE's ``selectWeightedModel``); None when
        the rule has no targets."""
        targets = rule.targets
        if not targets:
            return None
        if len(targets) == 1:
            return targets[0].model_rewrite
        total = sum(t.weight for t in targets)
        if total <= 0:
            return targets[self._rng.randrange(len(targets))].model_rewrite
        pick = self._rng.randrange(total)
        acc = 0
        for t in targets:
            acc += t.weight
            if pick < acc:
                return t.model_rewrite
        return targets[-1].model_rewrite  # unreachable: pick < total

    def rewrite(self, model: str) -> tuple[str, str] | None:
        """``(target model, rewrite name)`` for a request for ``model``, or None: no rule
        matches, or the winning rule has no targets."""
        hit = self.rule_for(model)
        if hit is None:
            return None
        target = self.choose_target(hit[0])
        return None if target is None else (target, hit[1])

    def objectives(self) -> list[Objective]:
        return list(self._objectives.values())

    def rewrites(self) -> list[ModelRewrite]:
        return list(self._rewrites.values())

    def __bool__(self) -> bool:
        return True  # a store is a store, empty or not (``if store:`` must not test size)

    def __len__(self) -> int:
        return len(self._objectives) + len(self._rewrites)

    # -- writes ---------------------------------------------------------------------
    def on_change(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener()`` after every change; returns an unsubscribe."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)
        return unsubscribe

    def set_objective(self, obj: Objective) -> None:
        if self._objectives.get(obj.name) != obj:
            self._objectives[obj.name] = obj
            self._changed()

    def delete_objective(self, name: str) -> bool:
        if self._objectives.pop(name, None) is None:
            return False
        self._changed()
        return True

    def set_rewrite(self, rw: ModelRewrite) -> None:
        if self._rewrites.get(rw.name) != rw:
            self._rewrites[rw.name] = rw
            self._reindex()
            self._changed()

    def delete_rewrite(self, name: str) -> bool:
        if self._rewrites.pop(name, None) is None:
            return False
        self._reindex()
        self._changed()
        return True

    def replace_objectives(self, objs: Iterable[Objective]) -> bool:
        """Make the objectives exactly ``objs`` (a later one of a name wins); True when
        that changed something."""
        new = {o.name: o for o in objs}
        if new == self._objectives:
            return False
        self._objectives = new
        self._changed()
        return True

    def replace_rewrites(self, rws: Iterable[ModelRewrite]) -> bool:
        """Make the model rewrites exactly ``rws``; True when that changed something."""
        new = {r.name: r for r in rws}
        if new == self._rewrites:
            return False
        self._rewrites = new
        self._reindex()
        self._changed()
        return True

    def replace(self, objs: Iterable[Objective], rws: Iterable[ModelRewrite]) -> bool:
        """Both kinds at once, one notification; True when something changed."""
        new_o = {o.name: o for o in objs}
        new_r = {r.name: r for r in rws}
        if new_o == self._objectives and new_r == self._rewrites:
            return False
        self._objectives = new_o
        if new_r != self._rewrites:
            self._rewrites = new_r
            self._reindex()
        self._changed()
        return True

    # -- replication to --workers fronts --------------------------------------------
    def export(self) -> dict[str, Any]:
        """The content as plain JSON values (what :meth:`load` takes)."""
        return {
            "objectives": [[o.name, o.priority] for o in self._objectives.values()],
            "rewrites": [[r.name, r.created, r.order,
                          [[list(rule.models), rule.generic,
                            [[t.model_rewrite, t.weight] for t in rule.targets]]
                           for rule in r.rules]]
                         for r in self._rewrites.values()],
        }

    def load(self, data: Mapping[str, Any]) -> bool:
        """Replace the content with an :meth:`export` (pool references are not carried:
        the exporting store has already selected by them)."""
        objs = [Objective(str(name), None if prio is None else int(prio))
                for name, prio in data.get("objectives") or ()]
        rws = [ModelRewrite(str(name), tuple(
                   RewriteRule(tuple(models), tuple(TargetModel(str(m), int(w))
                                                    for m, w in targets), bool(generic))
                   for models, generic, targets in rules), float(created), int(order))
               for name, created, order, rules in data.get("rewrites") or ()]
        return self.replace(objs, rws)

    # -- internals ------------------------------------------------------------------
    def _reindex(self) -> None:
        exact: dict[str, tuple[RewriteRule, str]] = {}
        generic: tuple[RewriteRule, str] | None = None
        for rw in sorted(self._rewrites.values(), key=lambda r: (r.created, r.order, r.name)):
            for rule in rw.rules:
                if rule.generic:
                    if generic is None:
                        generic = (rule, rw.name)
                    continue
                for model in rule.models:
                    exact.setdefault(model, (rule, rw.name))
        self._exact, self._generic = exact, generic

    def _changed(self) -> None:
        self.version += 1
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # a listener bug must not lose the update
                log.exception("objective store listener failed")


# ------------------------------------------------------------------ parsing API objects
def parse_object(obj: Mapping[str, Any], where: str, *, strict: bool,
                 require_pool_ref: bool = True) -> Objective | ModelRewrite:
    """An InferenceObjective or InferenceModelRewrite object → its value.

    ``where`` prefixes every error message (e.g. ``file.yaml: document 2``). ``strict``
    (the objectives file): ``apiVersion`` must be GIE's, and fields the CRD does not have
    are errors; otherwise (objects from the API server, which already validated them)
    unknown fields are ignored. Raises :class:`InvalidObject`.
    """
    if not isinstance(obj, Mapping):
        raise InvalidObject(f"{where}: expected a mapping (an API object), got "
                            f"{type(obj).__name__}")
    kind = obj.get("kind")
    if kind not in (keys.K8S_OBJECTIVE_KIND, keys.K8S_MODEL_REWRITE_KIND):
        raise InvalidObject(f"{where}: kind: expected {keys.K8S_OBJECTIVE_KIND} or "
                            f"{keys.K8S_MODEL_REWRITE_KIND}, got {kind!r}")
    api_version = obj.get("apiVersion")
    if strict and api_version != keys.K8S_OBJECTIVE_API_VERSION:
        raise InvalidObject(f"{where}: apiVersion: expected {keys.K8S_OBJECTIVE_API_VERSION}"
                            f" (the only version of {kind}), got {api_version!r}")
    if strict:
        _no_unknown(obj, {"apiVersion", "kind", "metadata", "spec", "status"}, where)
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        raise InvalidObject(f"{where}: metadata: expected a mapping with a name")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidObject(f"{where}: metadata.name: expected a non-empty string, "
                            f"got {name!r}")
    where = f"{where} ({kind} {name!r})"
    created = _timestamp(meta.get("creationTimestamp"), f"{where}: metadata.creationTimestamp")
    spec = obj.get("spec")
    if spec is None:
        spec = {}
    if not isinstance(spec, Mapping):
        raise InvalidObject(f"{where}: spec: expected a mapping")
    if kind == keys.K8S_OBJECTIVE_KIND:
        return _objective(name, spec, where, strict, require_pool_ref)
    return _model_rewrite(name, created, spec, where, strict, require_pool_ref)


def _objective(name: str, spec: Mapping[str, Any], where: str, strict: bool,
               require_pool_ref: bool) -> Objective:
    if strict:
        _no_unknown(spec, {"priority", "poolRef"}, f"{where}: spec")
    prio = spec.get("priority")
    if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int)):
        raise InvalidObject(f"{where}: spec.priority: expected an integer, got {prio!r}")
    ref = _pool_ref(spec.get("poolRef"), f"{where}: spec.poolRef", strict, require_pool_ref)
    return Objective(name, prio, ref)


def _model_rewrite(name: str, created: float, spec: Mapping[str, Any], where: str,
                   strict: bool, require_pool_ref: bool) -> ModelRewrite:
    if strict:
        _no_unknown(spec, {"poolRef", "rules"}, f"{where}: spec")
    ref = _pool_ref(spec.get("poolRef"), f"{where}: spec.poolRef", strict, require_pool_ref)
    raw_rules = spec.get("rules")
    if raw_rules is None:
        if strict:
            raise InvalidObject(f"{where}: spec.rules: required (a list of "
                                "{matches, targets})")
        raw_rules = []
    if not isinstance(raw_rules, list):
        raise InvalidObject(f"{where}: spec.rules: expected a list")
    rules = tuple(_rule(r, f"{where}: spec.rules[{i}]", strict)
                  for i, r in enumerate(raw_rules))
    return ModelRewrite(name, rules, created, 0, ref)


def _rule(raw: Any, where: str, strict: bool) -> RewriteRule:
    if not isinstance(raw, Mapping):
        raise InvalidObject(f"{where}: expected a mapping with matches and targets")
    if strict:
        _no_unknown(raw, {"matches", "targets"}, where)
    matches = raw.get("matches") or []
    if not isinstance(matches, list):
        raise InvalidObject(f"{where}.matches: expected a list")
    models: list[str] = []
    for j, m in enumerate(matches):
        mw = f"{where}.matches[{j}]"
        if not isinstance(m, Mapping):
            raise InvalidObject(f"{mw}: expected a mapping {{model: {{value: NAME}}}}")
        if strict:
            _no_unknown(m, {"model"}, mw)
        model = m.get("model")
        if model is None:
            if strict:
                raise InvalidObject(f"{mw}.model: required")
            continue  # GIE: a match without a model matches nothing
        if not isinstance(model, Mapping):
            raise InvalidObject(f"{mw}.model: expected a mapping {{type: Exact, value: NAME}}")
        if strict:
            _no_unknown(model, {"type", "value"}, f"{mw}.model")
        mtype = model.get("type", MATCH_EXACT)
        if mtype not in (None, MATCH_EXACT):
            raise InvalidObject(f"{mw}.model.type: only {MATCH_EXACT!r} is supported, "
                                f"got {mtype!r}")
        value = model.get("value")
        if not isinstance(value, str) or not value:
            raise InvalidObject(f"{mw}.model.value: expected a non-empty model name, "
                                f"got {value!r}")
        if value not in models:
            models.append(value)
    raw_targets = raw.get("targets")
    if raw_targets is None:
        raw_targets = []
    if not isinstance(raw_targets, list):
        raise InvalidObject(f"{where}.targets: expected a list of {{modelRewrite, weight}}")
    if strict and "targets" in raw and not raw_targets:
        raise InvalidObject(f"{where}.targets: at least one target (or leave targets out)")
    targets: list[TargetModel] = []
    for j, t in enumerate(raw_targets):
        tw = f"{where}.targets[{j}]"
        if not isinstance(t, Mapping):
            raise InvalidObject(f"{tw}: expected a mapping {{modelRewrite: NAME, weight: N}}")
        if strict:
            _no_unknown(t, {"modelRewrite", "weight"}, tw)
        target = t.get("modelRewrite")
        if not isinstance(target, str) or (strict and not target):
            raise InvalidObject(f"{tw}.modelRewrite: expected a model name, got {target!r}")
        weight = t.get("weight")
        if weight is None:
            weight = 0
        elif isinstance(weight, bool) or not isinstance(weight, int) \
                or not 1 <= weight <= MAX_WEIGHT:
            raise InvalidObject(f"{tw}.weight: expected an integer 1..{MAX_WEIGHT}, "
                                f"got {weight!r}")
        targets.append(TargetModel(target, weight))
    return RewriteRule(tuple(models), tuple(targets), generic=not matches)


def _pool_ref(raw: Any, where: str, strict: bool, required: bool) -> PoolRef | None:
    if raw is None:
        if required and strict:
            raise InvalidObject(f"{where}: required ({{name: POOL}})")
        return None
    if not isinstance(raw, Mapping):
        raise InvalidObject(f"{where}: expected a mapping {{name: POOL}}")
    if strict:
        _no_unknown(raw, {"group", "kind", "name"}, where)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidObject(f"{where}.name: expected the InferencePool's name, got {name!r}")
    group = raw.get("group", keys.K8S_POOL_GROUP)
    if group is None:
        group = keys.K8S_POOL_GROUP
    if not isinstance(group, str) or not _GROUP.match(group):
        raise InvalidObject(f"{where}.group: not an API group: {group!r}")
    kind = raw.get("kind") or keys.K8S_POOL_KIND
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise InvalidObject(f"{where}.kind: not a kind: {kind!r}")
    return PoolRef(name, group, kind)


def _timestamp(raw: Any, where: str) -> float:
    """RFC 3339 (``2025-01-02T03:04:05Z``; YAML may have decoded it already) → seconds
    since the epoch; 0 when absent."""
    if raw is None:
        return 0.0
    if isinstance(raw, datetime):
        dt = raw
    elif isinstance(raw, str):
        try:
            dt = datetime.fromisoformat(raw)
        except ValueError:
            raise InvalidObject(f"{where}: not an RFC 3339 time: {raw!r}") from None
    else:
        raise InvalidObject(f"{where}: not an RFC 3339 time: {raw!r}")
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _no_unknown(m: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in m if k not in allowed)
    if unknown:
        raise InvalidObject(f"{where}: unknown field(s) {unknown}; allowed: "
                            f"{', '.join(sorted(allowed))}")


def selects_pool(ref: PoolRef | None, pool_name: str, pool_group: str) -> bool:
    """GIE's reconciler predicate: the object references the pool by name and group (the
    kind is not compared)."""
    return ref is not None and ref.name == pool_name and ref.group == pool_group


def objects_of(items: Sequence[Objective | ModelRewrite]
               ) -> tuple[list[Objective], list[ModelRewrite]]:
    """Split parsed objects by kind, in their order."""
    objs = [o for o in items if isinstance(o, Objective)]
    rws = [r for r in items if isinstance(r, ModelRewrite)]
    return objs, rws
