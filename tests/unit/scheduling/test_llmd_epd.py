"""llm-d-router v0.10.0's encode stage (E/P/D, issue 18): ``encode-filter``,
``always-disagg-multimodal-decider``, the ``encode`` decider/profile keys of
``disagg-profile-handler`` and the ``x-encoder-hosts-ports`` header; llm-d's shipped
configs that use them (tests/fixtures/llm-d-router-v0.10.0/) loaded and routed against
fake endpoints.

Go sources: pkg/epp/framework/plugins/scheduling/filter/bylabel/roles.go,
pkg/epp/framework/plugins/scheduling/profilehandler/disagg/{disagg_profile_handler.go,
disagg_headers_handler.go, always_disagg_mm_decider.go, multimodal_helpers.go},
pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer/estimate.go (which chat
parts are media), pkg/common/routing/common.go (the header)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from epp import keys
from epp.config.loader import load_and_build
from epp.errors import ConfigError
from epp.framework.handle import PluginHandle
from epp.parsing.request import multimodal_items
from epp.scheduling.plugins.catalog import default_registry
from epp.scheduling.plugins.pd import (
    AlwaysDisaggMultimodalDecider,
    DisaggProfileHandler,
    PrefillHeaderHandler,
)
from epp.scheduling.plugins.roles import DecodeFilter, EncodeFilter, PrefillFilter
from epp.scheduling.types import (
    ApiType,
    CycleState,
    Endpoint,
    LLMRequest,
    ProfileRunResult,
    SchedulingResult,
)
from epp.server.options import ServeOptions, StaticSourceOptions, validate
from epp.server.wiring import PluginTimings, ServerParts, wire

FIXTURES = Path(__file__).parents[2] / "fixtures" / "llm-d-router-v0.10.0"
EPD_YAML = FIXTURES / "deploy/config/sim-e-p-d-epp-config.yaml"
EPD_PD_YAML = FIXTURES / "deploy/config/sim-e-pd-epp-config.yaml"
E2E_CONFIGS = FIXTURES / "test/e2e/configs_test.go"
SMOKE_CONFIGS = FIXTURES / "test/integration/epp/e2e_config_smoke_test.go"
COORDINATOR_CONFIGS = FIXTURES / "test/coordinator/e2e/coordinator/configs_test.go"
S = CycleState()


def go_configs(path: Path) -> dict[str, str]:
    """The EndpointPickerConfig YAML literals of a Go test file (``const x = `…```` and
    ``"x": `…```` map entries), by name."""
    out = {}
    for m in re.finditer(r'(?:const (\w+) = |"(\w+)": )`([^`]*)`', path.read_text()):
        if "EndpointPickerConfig" in m.group(3):
            out[m.group(1) or m.group(2)] = m.group(3)
    return out


def ep(i: int, role: str | None) -> Endpoint:
    return Endpoint(name=f"pod-{i}", address=f"10.0.0.{i}", port=8000,
                    labels={keys.LABEL_ROLE: role} if role else {})


ENCODE, PREFILL, DECODE = ep(1, "encode"), ep(2, "prefill"), ep(3, "decode")
PODS = [ENCODE, PREFILL, DECODE]

TEXT = {"model": "m", "messages": [{"role": "user", "content": "describe a cat " * 20}]}
IMAGE = {"model": "m", "messages": [{"role": "user", "content": [
    {"type": "text", "text": "what is in this image? " * 10},
    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}


def req(body: dict[str, Any] | None, headers: dict[str, str] | None = None) -> LLMRequest:
    r = LLMRequest(request_id="r", target_model="m", incoming_model="m",
                   api=ApiType.CHAT_COMPLETIONS, prompt="p " * 200, headers=headers or {})
    if body is not None:
        r.plugin_state[keys.PLUGIN_STATE_REQUEST_BODY] = body
    return r


def make(type_name: str, params: dict[str, Any] | None = None) -> Any:
    build = default_registry().builder(type_name, "t")
    return build(type_name, params, "plugins[0].parameters", PluginHandle())


# ======================================================================= detection


@pytest.mark.parametrize(("content", "want"), [
    ("plain text", ()),
    ([{"type": "text", "text": "hi"}], ()),
    ([{"type": "image_url", "image_url": {"url": "u"}}], ("image",)),
    ([{"type": "video_url", "video_url": {"url": "u"}}], ("video",)),
    ([{"type": "input_audio", "input_audio": {"data": "d", "format": "wav"}}], ("audio",)),
    ([{"type": "audio_url", "audio_url": {"url": "u"}}], ("audio",)),
    ([{"type": "image", "source": {"type": "base64", "data": "x"}}], ("image",)),  # Anthropic
    ([{"type": "file", "file": {"file_id": "f"}}], ()),  # not media for llm-d
    ([{"type": "image_url", "image_url": {"url": "a"}}, {"type": "text", "text": "t"},
      {"type": "image_url", "image_url": {"url": "b"}}], ("image", "image")),
])
def test_multimodal_items(content: Any, want: tuple[str, ...]) -> None:
    assert multimodal_items({"messages": [{"role": "user", "content": content}]}) == want


@pytest.mark.parametrize("data", [None, {}, {"prompt": "x"}, {"messages": "x"},
                                  {"messages": [1, {"content": [2, {"type": 3}]}]}])
def test_multimodal_items_of_other_bodies(data: Any) -> None:
    assert multimodal_items(data) == ()


def test_multimodal_decider() -> None:
    d = make("always-disagg-multimodal-decider")
    assert isinstance(d, AlwaysDisaggMultimodalDecider)
    assert d.disaggregate(S, req(IMAGE), DECODE)
    assert not d.disaggregate(S, req(TEXT), DECODE)
    assert not d.disaggregate(S, req(None), DECODE)  # no JSON body (gRPC, passthrough)


def test_multimodal_decider_takes_no_parameters() -> None:
    with pytest.raises(ConfigError, match="unknown"):
        load_and_build(None, "plugins:\n- type: always-disagg-multimodal-decider\n"
                       "  parameters: {threshold: 1}\n- type: decode-filter\n"
                       "schedulingProfiles:\n- name: d\n  plugins: [{pluginRef: decode-filter}]\n",
                       strict=True)


# ========================================================================= filters


@pytest.mark.parametrize(("role", "encode", "prefill", "decode"), [
    ("encode", True, False, False),
    ("encode-prefill", True, True, False),
    ("encode-prefill-decode", True, True, True),
    ("Encode", True, False, False),  # values compare lower-cased (this EPP's role filters)
    ("prefill", False, True, False),
    ("decode", False, False, True),
    ("prefill-decode", False, False, True),
    (None, False, False, True),  # unlabelled: decode only, never encode
])
def test_role_filters(role: str | None, encode: bool, prefill: bool, decode: bool) -> None:
    e = ep(7, role)
    assert list(EncodeFilter("e").filter(S, req(None), [e])) == ([e] if encode else [])
    assert list(PrefillFilter("p").filter(S, req(None), [e])) == ([e] if prefill else [])
    assert list(DecodeFilter("d").filter(S, req(None), [e])) == ([e] if decode else [])


def test_encode_filter_role_label() -> None:
    f = make("encode-filter", {"roleLabel": "example.com/role"})
    e = Endpoint(name="x", address="10.0.0.9", port=8000, labels={"example.com/role": "encode"})
    assert list(f.filter(S, req(None), [e, ENCODE])) == [e]


# ========================================================================= handler


def test_handler_parameters() -> None:
    h = make("disagg-profile-handler", {"profiles": {"encode": "enc"}})
    assert isinstance(h, DisaggProfileHandler)
    assert h.encode_profile == "enc" and h.encode_decider_name is None
    h = make("disagg-profile-handler", {"encodeProfile": "e2",
                                        "encodeDeciderPluginName": "mm",
                                        "prefillDeciderPluginName": "pd"})
    assert (h.encode_profile, h.encode_decider_name, h.decider_name) == ("e2", "mm", "pd")
    h = make("disagg-profile-handler", {})
    assert h.encode_profile == "encode"


@pytest.mark.parametrize(("params", "fragment"), [
    ({"deciders": {"other": "x"}}, "encode: DECIDER-PLUGIN-NAME"),
    ({"profiles": {"other": "x"}}, "encode: NAME"),
])
def test_handler_rejects(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        make("disagg-profile-handler", params)


def test_encode_decider_must_exist_and_be_a_decider() -> None:
    text = EPD_PD_YAML.read_text().replace("- type: always-disagg-multimodal-decider\n", "")
    with pytest.raises(ConfigError, match="deciders.encode: no plugin named "
                                          "'always-disagg-multimodal-decider'"):
        load_and_build(None, text)
    text = EPD_PD_YAML.read_text().replace("encode: always-disagg-multimodal-decider",
                                           "encode: encode-filter")
    with pytest.raises(ConfigError, match="deciders.encode: 'encode-filter'.*not an encode decider"):
        load_and_build(None, text)


def headers_of(parts: Any, result: SchedulingResult, r: LLMRequest) -> dict[str, str]:
    return dict(parts.request_headers(r, result))


def test_epd_yaml_multimodal_runs_encode_then_prefill() -> None:
    built = load_and_build(str(EPD_YAML), strict=True)
    h = built.scheduler.handler
    assert isinstance(h, DisaggProfileHandler)
    r = req(IMAGE)
    result = built.scheduler.schedule(r, PODS)
    assert result.primary_profile == "decode"
    assert result.primary.endpoints[0] == DECODE
    enc = result.profile_results["encode"]
    assert enc is not None and enc.endpoints == (ENCODE,)
    out = headers_of(h, result, r)
    assert out == {keys.HEADER_ENCODERS: "10.0.0.1:8000", keys.HEADER_PREFILLER: "10.0.0.2:8000"}
    assert h.decision(result) == "encode-prefill-decode"


def test_epd_yaml_text_skips_encode() -> None:
    built = load_and_build(str(EPD_YAML), strict=True)
    h = built.scheduler.handler
    assert isinstance(h, DisaggProfileHandler)
    r = req(TEXT)
    result = built.scheduler.schedule(r, PODS)
    assert "encode" not in result.profile_results
    out = headers_of(h, result, r)
    assert keys.HEADER_ENCODERS not in out and out[keys.HEADER_PREFILLER] == "10.0.0.2:8000"
    assert h.decision(result) == "disaggregated"


def test_epd_decider_is_asked_once_per_cycle() -> None:
    built = load_and_build(str(EPD_YAML), strict=True)
    h = built.scheduler.handler
    assert isinstance(h, DisaggProfileHandler)
    calls = []

    class Counting(AlwaysDisaggMultimodalDecider):
        def disaggregate(self, state: CycleState, request: LLMRequest, decode: Endpoint) -> bool:
            calls.append(decode)
            return False

    h.encode_decider = Counting("c")
    built.scheduler.schedule(req(IMAGE), PODS)
    assert calls == [DECODE]  # with the decode pick, once, before prefill


def test_epd_no_encode_pod_keeps_decode() -> None:
    built = load_and_build(str(EPD_PD_YAML), strict=True)
    h = built.scheduler.handler
    assert isinstance(h, DisaggProfileHandler)
    r = req(IMAGE)
    result = built.scheduler.schedule(r, [DECODE])
    assert result.primary.endpoints[0] == DECODE and result.profile_results["encode"] is None
    assert headers_of(h, result, r) == {}
    assert h.decision(result) == "decode-only"


def test_encode_without_decider_never_runs() -> None:
    text = EPD_PD_YAML.read_text().replace(
        "  parameters:\n    deciders:\n      encode: always-disagg-multimodal-decider\n", "")
    built = load_and_build(None, text)
    result = built.scheduler.schedule(req(IMAGE), PODS)
    assert set(result.profile_results) == {"decode"}


def test_encode_header_lists_every_encode_endpoint() -> None:
    h = PrefillHeaderHandler("h")
    e2 = ep(4, "encode")
    result = SchedulingResult({"decode": ProfileRunResult((DECODE,)),
                               "encode": ProfileRunResult((ENCODE, e2))}, "decode")
    assert h.request_headers(req(None), result) == {
        keys.HEADER_ENCODERS: "10.0.0.1:8000,10.0.0.4:8000"}
    custom = make("disagg-headers-handler", {"encodeProfile": "my-encode"})
    result = SchedulingResult({"decode": ProfileRunResult((DECODE,)),
                               "my-encode": ProfileRunResult((ENCODE,))}, "decode")
    assert custom.request_headers(req(None), result) == {keys.HEADER_ENCODERS: "10.0.0.1:8000"}


def test_encoder_header_is_a_routing_header() -> None:
    # Never accepted from clients: Envoy is told to remove it unless the EPP sets it.
    assert keys.HEADER_ENCODERS in keys.ROUTING_HEADERS


# ====================================================== llm-d's configs, end to end


def server(path: Path | None, text: str | None, eps: list[Endpoint]) -> ServerParts:
    timings = PluginTimings()
    built = load_and_build(str(path) if path else None, text, timer=timings)
    parts = wire(validate(ServeOptions(static=StaticSourceOptions(
        endpoints=",".join(e.key for e in eps)))), built, timings, None)
    parts.store.set_endpoints(eps)
    return parts


async def route(parts: ServerParts, body: dict[str, Any],
                **extra: str) -> tuple[str, dict[str, str]]:
    d = parts.director
    hdrs = {":method": "POST", ":path": "/v1/chat/completions", "x-request-id": "r", **extra}
    routing = await d.route(hdrs, orjson.dumps(body), True, None)
    d.on_response_headers(routing.context, 200, {"content-type": "application/json"})
    d.on_response_body(routing.context, b"{}", True)
    d.on_done(routing.context, aborted=False)
    return routing.destination, dict(routing.set_headers)


E2E = go_configs(E2E_CONFIGS)
SMOKE = go_configs(SMOKE_CONFIGS)
EPD_SOURCES: list[tuple[str, Path | None, str | None]] = [
    ("sim-e-p-d-epp-config.yaml", EPD_YAML, None),
    ("sim-e-pd-epp-config.yaml", EPD_PD_YAML, None),
    ("e2e epdEncodeDecodeConfig", None, E2E["epdEncodeDecodeConfig"]),
    ("e2e epdConfig", None, E2E["epdConfig"]),
    ("smoke epdConfig", None, SMOKE["epdConfig"]),
]


@pytest.mark.parametrize(("label", "path", "text"), EPD_SOURCES, ids=[s[0] for s in EPD_SOURCES])
async def test_llmd_epd_configs_route(label: str, path: Path | None, text: str | None) -> None:
    load_and_build(str(path) if path else None, text, strict=True)
    parts = server(path, text, PODS)
    dest, hdrs = await route(parts, IMAGE)
    assert dest.split(",")[0] == DECODE.key
    assert hdrs[keys.HEADER_ENCODERS] == ENCODE.key  # encode pod chosen for the image
    dest, hdrs = await route(parts, TEXT)
    assert dest.split(",")[0] == DECODE.key
    assert keys.HEADER_ENCODERS not in hdrs  # skipped for text


@pytest.mark.parametrize("text", [E2E["decodeOnlyConfig"], SMOKE["decodeOnlyConfig"]])
async def test_llmd_decode_only_config_declares_encode_filter_unused(text: str) -> None:
    load_and_build(None, text, strict=True)
    parts = server(None, text, PODS)
    dest, hdrs = await route(parts, IMAGE)
    assert dest.split(",")[0] == DECODE.key and keys.HEADER_ENCODERS not in hdrs


async def test_llmd_generate_encode_config_routes_to_encode_pods() -> None:
    text = E2E["generateEncodeConfig"]  # single-profile-handler over encode-filter
    load_and_build(None, text, strict=True)
    parts = server(None, text, PODS)
    dest, _ = await route(parts, IMAGE)
    assert dest.split(",")[0] == ENCODE.key


@pytest.mark.parametrize(("profile", "want"), [("encode", ENCODE), ("prefill", PREFILL),
                                                ("decode", DECODE)])
async def test_llmd_coordinator_config_profiles(profile: str, want: Endpoint) -> None:
    text = go_configs(COORDINATOR_CONFIGS)["eppConfig"]  # header-profile-handler
    load_and_build(None, text, strict=True)
    parts = server(None, text, PODS)
    dest, _ = await route(parts, IMAGE, **{"epp-profile": profile})
    assert dest.split(",")[0] == want.key


def test_fixture_readme_lists_the_configs() -> None:
    readme = (FIXTURES / "README.md").read_text()
    for path in (EPD_YAML, EPD_PD_YAML, E2E_CONFIGS, SMOKE_CONFIGS, COORDINATOR_CONFIGS):
        assert f"`{path.relative_to(FIXTURES)}`" in readme
