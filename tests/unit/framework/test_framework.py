"""The plugin framework's own contract: typed parameters, the handle, the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from epp.errors import ConfigError
from epp.framework.handle import BindsPlugins, PluginHandle
from epp.framework.interfaces import Scorer
from epp.framework.params import (
    NoParameters,
    ParameterError,
    accepted_keys,
    decode_params,
    decoding,
    param,
    positive_duration,
)
from epp.framework.registry import Registry
from epp.scheduling.plugins.catalog import BUILTIN_PLUGINS, default_registry
from epp.scheduling.plugins.prefix import ApproxPrefixCacheProducer, PrefixCacheScorer
from epp.scheduling.plugins.scorers import QueueScorer


def _upper(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{path}: expected a name")
    return v.upper()


@dataclass(frozen=True)
class Sample:
    count: int = param("count", 3, minimum=1, maximum=10)
    ratio: float = param("ratio", 0.5, minimum=0.0)
    on: bool = param("on", True)
    label: str | None = param("label")
    timeout: float = param("timeout", 1.0, parse=positive_duration)
    shout: str = param("shout", "x", parse=_upper)

    def __post_init__(self) -> None:
        if self.label == "forbidden":
            raise ParameterError("label", "must not be 'forbidden'")


def test_defaults_and_values() -> None:
    assert decode_params(Sample, None, "p") == Sample()
    got = decode_params(Sample, {"count": 4, "ratio": 2, "on": False, "label": "a",
                                 "timeout": "250ms", "shout": "hey"}, "p")
    assert got == Sample(4, 2.0, False, "a", 0.25, "HEY")
    assert isinstance(got.ratio, float)
    # null means "not set": the default applies.
    assert decode_params(Sample, {"count": None}, "p").count == 3


@pytest.mark.parametrize(("raw", "message"), [
    ({"count": 0}, "plugins[1].parameters.count: must be >= 1, got 0"),
    ({"count": 11}, "plugins[1].parameters.count: must be <= 10, got 11"),
    ({"count": True}, "plugins[1].parameters.count: expected an integer, got True"),
    ({"count": 1.5}, "plugins[1].parameters.count: expected an integer, got 1.5"),
    ({"ratio": "x"}, "plugins[1].parameters.ratio: expected a number, got 'x'"),
    ({"on": "yes"}, "plugins[1].parameters.on: expected true or false, got 'yes'"),
    ({"label": 5}, "plugins[1].parameters.label: expected a string, got 5"),
    ({"timeout": "0s"}, "plugins[1].parameters.timeout: must be > 0, got 0s"),
    ({"timeout": "soon"}, "plugins[1].parameters.timeout: expected a duration"),
    ({"shout": 1}, "plugins[1].parameters.shout: expected a name"),
    ({"label": "forbidden"}, "plugins[1].parameters.label: must not be 'forbidden'"),
    ({"cuont": 2, "zz": 1}, ("plugins[1].parameters.cuont, plugins[1].parameters.zz: unknown "
                             "parameter (did you mean 'count'?); this plugin accepts: count, "
                             "label, on, ratio, shout, timeout")),
])
def test_errors_name_the_path(raw: dict[str, Any], message: str) -> None:
    with decoding(strict=True), pytest.raises(ConfigError) as info:
        decode_params(Sample, raw, "plugins[1].parameters")
    assert message in str(info.value)


def test_parameters_must_be_a_mapping_and_none_takes_no_keys() -> None:
    with pytest.raises(ConfigError, match="p: parameters must be a mapping, got list"):
        decode_params(Sample, [1], "p")
    with decoding(strict=True), \
            pytest.raises(ConfigError, match="p.x: unknown parameter; this plugin accepts: none"):
        decode_params(NoParameters, {"x": 1}, "p")
    # Without strict mode (GIE's behaviour) the key is ignored, with a warning.
    with decoding() as policy:
        assert decode_params(NoParameters, {"x": 1}, "p") == NoParameters()
    assert [w for w in policy.warnings if "p.x: unknown parameter" in w]
    assert accepted_keys(Sample) == ["count", "label", "on", "ratio", "shout", "timeout"]


def test_every_builtin_declares_typed_parameters_that_decode_empty() -> None:
    for cls in BUILTIN_PLUGINS:
        assert decode_params(cls.Parameters, {}, "p") is not None, cls  # type: ignore[attr-defined]
    assert sorted(default_registry().types) == sorted(
        c.type_name for c in BUILTIN_PLUGINS)  # type: ignore[attr-defined]


def test_handle_lookups() -> None:
    q = QueueScorer("q")
    producer = ApproxPrefixCacheProducer("prefix")
    handle = PluginHandle({"q": q, "prefix": producer})
    assert handle.named("q", QueueScorer) is q
    assert handle.named("missing", QueueScorer) is None
    with pytest.raises(ConfigError, match="plugin 'prefix' .* is not a queue-scorer"):
        handle.named("prefix", QueueScorer)
    assert handle.of_type(Scorer) == [q]
    assert handle.of_type(ApproxPrefixCacheProducer) == [producer]
    with pytest.raises(ConfigError, match="a plugin named 'q' already exists"):
        handle.add(QueueScorer("q"))
    handle.add(QueueScorer("q2"))
    assert [p.name for p in handle] == ["q", "prefix", "q2"]


def test_bind_is_an_interface_and_adds_the_helper_it_creates() -> None:
    scorer = PrefixCacheScorer("pc")
    assert isinstance(scorer, BindsPlugins)
    assert not isinstance(QueueScorer("q"), BindsPlugins)
    handle = PluginHandle({"pc": scorer})
    scorer.bind(handle)
    assert handle.get("pc-producer") is scorer.producer


def test_registry_rejects_duplicates_and_unknown_types() -> None:
    reg = Registry()
    reg.register_class(QueueScorer)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register_class(QueueScorer)
    with pytest.raises(ConfigError, match="f.yaml: unknown plugin type 'nope'; known types: "
                                          "queue-scorer"):
        reg.builder("nope", "f.yaml")
    plugin = reg.create("queue-scorer", "qq", PluginHandle())
    assert isinstance(plugin, QueueScorer) and plugin.name == "qq"
