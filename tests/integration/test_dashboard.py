"""The Grafana dashboard and the Prometheus alert rules in deploy/grafana/ query only what
the EPP really exports.

Every PromQL expression of the dashboard (panel targets, template-variable queries) and of
the alert rules is tokenized and its metric names, label matchers and grouping labels are
pulled out (functions, aggregations, keywords, strings, ranges, numbers and Grafana's
``$variables`` are told apart from metric names). They are compared with live scrapes of
``/metrics``: one of an EPP on the built-in default config after OK and failing requests
through real Envoy, one of an EPP on config/pd.yaml (P/D decisions only exist with a P/D
profile handler) after requests that produce both decision types, two of an EPP with the
``flowControl`` feature gate (one while requests wait in its queue, one after a burst that
was partly dispatched and partly rejected). A name must have
samples in a scrape (a declared but empty family does not count); ``_bucket``/``_sum``/
``_count`` must belong to a histogram; every label a query filters or groups on must be on
a series it reads. docs/observability.md must list every exported family.

The "Flow control" row's panels must also return data: every selector of their queries,
with ``$pool`` and ``$model`` set to the values the dashboard's variables would offer,
matches a sample with a non-zero value in the flow-control scrapes.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epp.stack.pd import PdStack, grove_layout, repo_config
from epp.stack.procs import free_port
from tests.integration.conftest import (
    MAX_BODY,
    ROOT,
    Upstreams,
    eventually,
    start_sims,
    start_stack,
    stop_stack,
)

DASHBOARD = ROOT / "deploy" / "grafana" / "epp-dashboard.json"
ALERTS = ROOT / "deploy" / "grafana" / "epp-alerts.yaml"
ALERT_TESTS = ROOT / "deploy" / "grafana" / "epp-alerts.test.yaml"
OBS_DOC = ROOT / "docs" / "observability.md"

# ----------------------------------------------------------------------------- PromQL

AGGREGATIONS = {"sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk",
                "quantile", "count_values", "group", "limitk", "limit_ratio"}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh",
    "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh",
    "count_over_time", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "deg",
    "delta", "deriv", "exp", "floor", "histogram_avg", "histogram_count", "histogram_fraction",
    "histogram_quantile", "histogram_stddev", "histogram_stdvar", "histogram_sum",
    "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace",
    "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time",
    "minute", "month", "pi", "predict_linear", "present_over_time", "quantile_over_time",
    "rad", "rate", "resets", "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_desc",
    "sort_by_label", "sort_by_label_desc", "sqrt", "stddev_over_time", "stdvar_over_time",
    "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year",
}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"} | GROUPING
# Grafana's built-in interval variables; each stands for a duration inside [...].
GRAFANA_INTERVALS = re.compile(r"\$(?:\{__\w+\}|__\w+)")

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*(?![\w:]))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){},@])
""", re.VERBOSE)


@dataclass
class Query:
    """What one PromQL expression reads."""

    expr: str
    metrics: set[str] = field(default_factory=set)
    matchers: dict[str, set[str]] = field(default_factory=dict)  # metric -> label names
    grouping: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)
    quantile_inputs: set[str] = field(default_factory=set)  # metrics inside histogram_quantile


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot tokenize PromQL at {expr[pos:pos + 30]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup not in ("ws", "comment"):
            out.append((m.lastgroup or "", m.group()))
    return out


def parse_promql(expr: str) -> Query:
    """Metric names, label matchers, grouping labels and functions of ``expr``."""
    q = Query(expr)
    # A Grafana variable other than the interval ones outside a string does not tokenize.
    toks = _tokens(GRAFANA_INTERVALS.sub("5m", expr))
    depth_quantile: list[int] = []  # paren depths at which a histogram_quantile( opened
    depth = 0
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "op" and text == "(":
            depth += 1
        elif kind == "op" and text == ")":
            depth -= 1
            if depth_quantile and depth_quantile[-1] == depth:
                depth_quantile.pop()
        elif kind == "ident" and text.lower() in GROUPING:
            if nxt == "(":  # by (a, b) / on (a) / group_left (a)
                j = i + 2
                while toks[j][1] != ")":
                    if toks[j][0] == "ident":
                        q.grouping.add(toks[j][1])
                    elif toks[j][1] != ",":
                        raise ValueError(f"bad label list in {expr!r}")
                    j += 1
                i = j + 1
                continue
        elif kind == "ident" and nxt == "(" and text.lower() not in KEYWORDS:
            name = text
            if name not in FUNCTIONS and name not in AGGREGATIONS:
                raise ValueError(f"unknown PromQL function {name!r} in {expr!r}")
            q.functions.add(name)
            if name == "histogram_quantile":
                depth_quantile.append(depth)
        elif kind == "ident" and text in AGGREGATIONS:  # sum by (x) (...) / sum(...) by (x)
            q.functions.add(text)
        elif kind == "ident" and text.lower() not in KEYWORDS:
            q.metrics.add(text)
            if depth_quantile:
                q.quantile_inputs.add(text)
            labels = q.matchers.setdefault(text, set())
            if nxt == "{":
                i = _matchers(toks, i + 2, labels, expr)
                continue
        elif kind == "op" and text == "{":  # {__name__="x", ...} with no leading name
            raise ValueError(f"selector without a metric name in {expr!r}")
        i += 1
    if depth != 0:
        raise ValueError(f"unbalanced parentheses in {expr!r}")
    return q


def _matchers(toks: list[tuple[str, str]], j: int, labels: set[str], expr: str) -> int:
    """Read ``label op "value", ...}`` from ``toks[j]``; return the index after ``}``."""
    while toks[j][1] != "}":
        name, op, value = toks[j], toks[j + 1], toks[j + 2]
        if name[0] != "ident" or op[1] not in ("=", "!=", "=~", "!~") or value[0] != "string":
            raise ValueError(f"bad label matcher near {name[1]!r} in {expr!r}")
        labels.add(name[1])
        j += 3
        if toks[j][1] == ",":
            j += 1
    return j + 1


def test_promql_parser() -> None:
    q = parse_promql('histogram_quantile(0.99, sum by (le, model_name) (rate('
                     'x_seconds_bucket{model_name=~"$model", a!="b"}[$__rate_interval])))')
    assert q.metrics == {"x_seconds_bucket"} == q.quantile_inputs
    assert q.matchers == {"x_seconds_bucket": {"model_name", "a"}}
    assert q.grouping == {"le", "model_name"}
    assert q.functions == {"histogram_quantile", "sum", "rate"}
    q = parse_promql('sum(rate(a_total[5m])) / sum without (x) (b) > 0.1 and on (role) '
                     '(max by (role) (c{name="p"}) > 0) or vector(0) offset 1h')
    assert q.metrics == {"a_total", "b", "c"} and q.grouping == {"x", "role"}
    q = parse_promql("absent(up) unless count by (job) (up) == bool 1e3")
    assert q.metrics == {"up"} and q.grouping == {"job"}
    for bad in ("rat(x[5m])", "sum(x", 'x{a~"b"}', "x[5m] $pool", '{__name__="x"}'):
        with pytest.raises(ValueError):
            parse_promql(bad)


# ----------------------------------------------------------------------------- sources

def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def dashboard_queries() -> dict[str, str]:
    """{where: expr} for every PromQL expression in the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    out: dict[str, str] = {}
    for p in _panels(dash["panels"]):
        for t in p.get("targets", []):
            out[f"panel {p['title']!r} {t['refId']}"] = t["expr"]
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert m, f"variable {v['name']}: unsupported query {query!r}"
        # label_values(series, label): the series must carry the label.
        out[f"variable {v['name']}"] = f"count by ({m.group(2)}) ({m.group(1)})"
    return out


def alert_queries() -> dict[str, str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return {f"alert {r.get('alert') or r.get('record')}": r["expr"]
            for g in doc["groups"] for r in g["rules"]}


def test_dashboard_shape() -> None:
    """Importable as is: a datasource variable every panel uses, unique ids, a 24-wide grid."""
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in _panels(dash["panels"])]
    assert len(ids) == len(set(ids))
    for p in _panels(dash["panels"]):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t.get("datasource", p["datasource"])["uid"] == "${datasource}"
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")):
                assert label in parse_promql(t["expr"]).grouping, (
                    f"{p['title']}: legend label {label} is not kept by the query")


def test_alert_rules_with_promtool() -> None:
    """`promtool check rules` and the rules' unit tests (epp-alerts.test.yaml)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    for args in (["check", "rules", str(ALERTS)], ["test", "rules", str(ALERT_TESTS)]):
        r = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60,
                           cwd=ALERTS.parent, check=False)
        assert r.returncode == 0, r.stdout + r.stderr


# ----------------------------------------------------------------------------- live scrapes

@dataclass
class Exported:
    """What a scrape holds: sample names with their label names, and family types."""

    samples: dict[str, set[str]] = field(default_factory=dict)
    families: dict[str, str] = field(default_factory=dict)  # family -> type
    family_of: dict[str, str] = field(default_factory=dict)  # sample name -> family

    def add(self, text: str) -> None:
        for fam in text_string_to_metric_families(text):
            self.families[fam.name] = fam.type
            for s in fam.samples:
                self.samples.setdefault(s.name, set()).update(s.labels)
                self.family_of[s.name] = fam.name


async def _post(session: aiohttp.ClientSession, url: str, body: bytes | dict[str, Any],
                want: int) -> None:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(url, data=data, headers={"content-type": "application/json"}) as r:
        payload = await r.read()
        assert r.status == want, (url, r.status, payload[:300])


async def _scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as r:
        assert r.status == 200
        return await r.text()


def _value(text: str, metric: str, **labels: str) -> float:
    """Sum of the samples named ``metric`` whose labels include ``labels``."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def _default_stack_scrape(upstreams: Upstreams, session: aiohttp.ClientSession,
                                workdir: Path) -> str:
    """Built-in default config; OK requests (plain, streamed, repeated prompts so the
    model servers report cached tokens) and errors the EPP and the model servers cause."""
    # GIE's shape ("inline"): the token panels need usage read from response bodies.
    s = await start_stack("FULL_DUPLEX_STREAMED", upstreams, workdir, config=None,
                          response_path="inline")
    try:
        prompt = " ".join(f"word{i}" for i in range(64))
        ok: list[tuple[str, dict[str, Any]]] = []
        for i in range(3):
            ok.append(("/v1/completions", {"model": "dash-model", "prompt": prompt,
                                           "max_tokens": 4}))
            ok.append(("/v1/chat/completions", {
                "model": "dash-model", "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"{prompt} question {i}"}]}))
        for path, body in ok:
            await _post(session, s.url + path, body, 200)
        # Errors: (path, body, status, model label). The EPP rejects the first three;
        # the model server answers the last two after the EPP routed them.
        errors = [
            ("/v1/completions", b"not json", 400, ""),
            ("/v1/completions", b'{"model": "dash-model"}', 400, ""),  # no prompt
            ("/v1/completions", b'{"model":"m","prompt":"' + b"x" * (MAX_BODY + 1) + b'"}',
             413, ""),
            ("/v1/no-such-api", b'{"model": "dash-model", "prompt": "hi"}', 404, "dash-model"),
            ("/v1/completions",
             b'{"model": "dash-model", "prompt": "hi", "max_tokens": 1000000000}', 400,
             "dash-model"),
        ]
        for path, raw, status, _ in errors:
            await _post(session, s.url + path, raw, status)
        routed = len(ok) + sum(1 for e in errors if e[3])
        # A stream's outcome is counted when Envoy closes the ext_proc stream, which can
        # be just after the client has its response: wait (bounded) for all of them.
        async def all_counted() -> str | None:
            text = await _scrape(session, f"http://127.0.0.1:{s.epp.metrics_port}/metrics")
            done = _value(text, "epp_extproc_streams_total", outcome="completed") == routed
            return text if done else None

        text = await eventually(all_counted, timeout=10, interval=0.1,
                                what=f"{routed} completed ext_proc streams")
    finally:
        await stop_stack(s)
    # The scrape shows the traffic sent: counts and error codes.
    assert _value(text, "inference_objective_request_total", model_name="dash-model") == routed
    assert _value(text, "inference_objective_request_duration_seconds_count",
                  model_name="dash-model") == len(ok)
    # GIE's error codes: the EPP's 400 and 413 are BadRequest; a model server's error
    # response (after routing: a model label) is ModelServerError.
    for code, model in (("BadRequest", ""), ("ModelServerError", "dash-model")):
        want = sum(1 for e in errors if e[3] == model)
        assert _value(text, "inference_objective_request_error_total", error_code=code,
                      model_name=model) == want, (code, model)
    assert _value(text, "inference_objective_request_error_total") == len(errors)
    assert _value(text, "epp_extproc_streams_total", outcome="completed") == routed
    assert _value(text, "epp_extproc_streams_total", outcome="rejected") == 3
    assert _value(text, "inference_objective_input_tokens_count") == len(ok)
    assert _value(text, "inference_objective_prompt_cached_tokens_sum") > 0
    assert _value(text, "inference_pool_ready_pods", name="static") == 3
    return text


async def _pd_stack_scrape(session: aiohttp.ClientSession, workdir: Path) -> str:
    """config/pd.yaml over one prefill and one decode pod: a long new prompt is
    disaggregated, the same prompt again is cached on the decode pod (decode-only)."""
    layout = grove_layout(racks=("rack-1",), prefill_per_rack=1, decode_per_rack=1)
    async with PdStack(workdir, layout, config_file=repo_config("pd.yaml")) as pd:
        long_prompt = " ".join(f"pd{i}" for i in range(400))
        body = {"model": "sim-model", "max_tokens": 2,
                "messages": [{"role": "user", "content": long_prompt}]}
        for _ in range(2):
            await _post(session, pd.url + "/v1/chat/completions", body, 200)
        text = await _scrape(session, pd.metrics_url)
    assert _value(text, "epp_pd_decisions_total", decision_type="disaggregated") >= 1
    assert _value(text, "epp_pd_decisions_total", decision_type="decode-only") >= 1
    return text


FC_CAPACITY = 3  # flowControl.maxRequests
FC_CONFIG = f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters: {{maxConcurrency: 1}}
- type: queue-scorer
- type: max-score-picker
saturationDetector:
  pluginRef: concurrency-detector
flowControl:
  maxRequests: {FC_CAPACITY}
  defaultRequestTTL: 60s
"""
FC_QUEUE_DURATION = "inference_extension_flow_control_request_queue_duration_seconds"


async def _flow_control_scrapes(session: aiohttp.ClientSession, workdir: Path) -> list[str]:
    """Flow control on (the feature gate) over one slow pod (100 ms per token) that takes
    one request at a time and a queue of three: a burst of eight from two tenants, so that
    requests wait in the queue (scraped then: queue size and bytes, saturation) and the
    overflow is rejected with 429; scraped again when every request has its outcome."""
    ports = [free_port()]
    sim = await start_sims(ports, workdir / "sim.log", "--decode-base-ms", "100")
    try:
        s = await start_stack("FULL_DUPLEX_STREAMED", Upstreams(ports, sim), workdir,
                              endpoint_ports=ports, config=FC_CONFIG)
        try:
            metrics_url = f"http://127.0.0.1:{s.epp.metrics_port}/metrics"

            async def post(i: int) -> int:
                body = orjson.dumps({"model": "fc-model", "prompt": "one two", "max_tokens": 5})
                async with session.post(s.url + "/v1/completions", data=body, headers={
                        "content-type": "application/json",
                        "x-gateway-inference-fairness-id": f"tenant-{i % 2}"}) as r:
                    await r.read()
                    return r.status

            n = 8
            burst = [asyncio.ensure_future(post(i)) for i in range(n)]

            async def queued() -> str | None:
                text = await _scrape(session, metrics_url)
                busy = (_value(text, "inference_extension_flow_control_queue_size") > 0
                        and _value(text, "inference_extension_flow_control_queue_bytes") > 0
                        and _value(text, "inference_extension_flow_control_pool_saturation") > 0)
                return text if busy else None

            try:
                mid = await eventually(queued, timeout=10, interval=0.02,
                                       what="requests waiting in flow control")
            finally:
                statuses = Counter(await asyncio.gather(*burst))

            async def all_out() -> str | None:
                text = await _scrape(session, metrics_url)
                return text if _value(text, FC_QUEUE_DURATION + "_count") == n else None

            end = await eventually(all_out, timeout=10, interval=0.1,
                                   what=f"{n} flow-control outcomes")
        finally:
            await stop_stack(s)
    finally:
        await sim.stop()
    # One served at once, three from the queue in turn, the overflow rejected (429), and
    # the rejections counted with GIE's error code.
    assert set(statuses) <= {200, 429} and statuses[200] >= 1 + FC_CAPACITY, statuses
    assert statuses[429] >= 1, statuses
    assert _value(end, FC_QUEUE_DURATION + "_count", outcome="Dispatched") == statuses[200]
    assert _value(end, FC_QUEUE_DURATION + "_count", outcome="RejectedCapacity") == \
        statuses[429]
    assert _value(end, "inference_objective_request_error_total",
                  error_code="ResourceExhausted") == statuses[429]
    assert _value(end, "inference_extension_flow_control_queue_size") == 0
    return [mid, end]


_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def _selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric, [(label, op, value)]) for every series selector of ``expr``."""
    out = []
    for name in parse_promql(expr).metrics:
        for m in re.finditer(rf"(?<![\w:]){re.escape(name)}(?![\w:])(\{{[^}}]*\}})?", expr):
            out.append((name, _MATCHER.findall(m.group(1) or "")))
    return out


def _matches(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    for label, op, value in matchers:
        have = labels.get(label, "")
        hit = (re.fullmatch(value, have) is not None) if op in ("=~", "!~") else have == value
        if hit != (op in ("=", "=~")):
            return False
    return True


def _variable_values(texts: list[str]) -> dict[str, str]:
    """What the dashboard's ``$pool`` and ``$model`` offer for these scrapes, as the regex
    Grafana puts in their place when all values are selected."""
    dash = json.loads(DASHBOARD.read_text())
    out: dict[str, str] = {}
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query.strip())
        assert m, query
        values = {s.labels[m.group(2)] for text in texts
                  for fam in text_string_to_metric_families(text) for s in fam.samples
                  if s.name == m.group(1) and s.labels.get(m.group(2))}
        assert values, f"variable {v['name']}: no values in the flow-control scrapes"
        out[v["name"]] = "|".join(sorted(re.escape(x) for x in values))
    return out


def _flow_control_panels_without_data(texts: list[str]) -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    row = next(p for p in rows if p["title"] == "Flow control")
    below = [p["gridPos"]["y"] for p in rows if p["gridPos"]["y"] > row["gridPos"]["y"]]
    end = min(below, default=1 << 30)
    panels = [p for p in dash["panels"] if p["type"] != "row"
              and row["gridPos"]["y"] < p["gridPos"]["y"] < end]
    assert len(panels) >= 6, [p["title"] for p in panels]
    variables = _variable_values(texts)
    samples = [s for text in texts for fam in text_string_to_metric_families(text)
               for s in fam.samples]
    problems = []
    for p in panels:
        for t in p["targets"]:
            expr = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)),
                          t["expr"])
            for name, matchers in _selectors(expr):
                if not any(s.name == name and s.value > 0 and _matches(s.labels, matchers)
                           for s in samples):
                    problems.append(f"panel {p['title']!r} {t['refId']}: {name}{matchers} "
                                    "selects no non-zero sample")
    return problems


async def test_dashboard_and_alerts_use_only_exported_metrics(
        upstreams: Upstreams, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    (tmp_path / "default").mkdir()
    default_text = await _default_stack_scrape(upstreams, session, tmp_path / "default")
    pd_text = await _pd_stack_scrape(session, tmp_path / "pd")
    (tmp_path / "fc").mkdir()
    fc_texts = await _flow_control_scrapes(session, tmp_path / "fc")
    exported = Exported()
    exported.add(default_text)
    exported.add(pd_text)
    for text in fc_texts:
        exported.add(text)

    queries = {**dashboard_queries(), **alert_queries()}
    assert len(queries) > 40
    used: set[str] = set()
    problems: list[str] = []
    for where, expr in sorted(queries.items()):
        q = parse_promql(expr)
        if not q.metrics:
            problems.append(f"{where}: reads no metric: {expr}")
        labels_read: set[str] = set()
        for name in q.metrics:
            if name not in exported.samples:
                problems.append(f"{where}: {name} is not exported (no samples in the scrapes)")
                continue
            family = exported.family_of[name]
            used.add(family)
            kind = exported.families[family]
            suffix = name[len(family):]
            if suffix in ("_bucket", "_sum", "_count") and kind != "histogram":
                problems.append(f"{where}: {name}: {family} is a {kind}, not a histogram")
            if name in q.quantile_inputs and suffix != "_bucket":
                problems.append(f"{where}: histogram_quantile over {name}, not a _bucket")
            have = exported.samples[name]
            labels_read |= have
            for label in q.matchers.get(name, set()) - have:
                problems.append(f"{where}: {name} has no label {label!r} (has {sorted(have)})")
        for label in q.grouping - labels_read:
            problems.append(f"{where}: groups by {label!r}, which none of "
                            f"{sorted(q.metrics)} has")
    problems += _flow_control_panels_without_data(fc_texts)
    assert not problems, "\n".join(problems)
    # The dashboard covers the GIE metrics and the project's own that matter to operators.
    for family in ("inference_objective_request", "inference_objective_request_error",
                   "inference_objective_request_duration_seconds",
                   "inference_objective_input_tokens", "inference_objective_output_tokens",
                   "inference_objective_prompt_cached_tokens",
                   "inference_objective_running_requests",
                   "inference_pool_average_kv_cache_utilization",
                   "inference_pool_average_queue_size", "inference_pool_ready_pods",
                   "inference_pool_per_pod_queue_size",
                   "inference_extension_scheduler_e2e_duration_seconds",
                   "inference_extension_plugin_duration_seconds", "inference_extension_info",
                   "epp_pd_decisions", "epp_extproc_streams", "epp_model_server_scrapes",
                   "epp_model_server_metrics_stale_endpoints",
                   FC_QUEUE_DURATION,
                   "inference_extension_flow_control_dispatch_cycle_duration_seconds",
                   "inference_extension_flow_control_request_enqueue_duration_seconds",
                   "inference_extension_flow_control_queue_size",
                   "inference_extension_flow_control_queue_bytes",
                   "inference_extension_flow_control_pool_saturation"):
        assert family in used, f"the dashboard and alerts do not use {family}"

    # docs/observability.md lists every exported family (the rows of the tables of its
    # "Metrics" section name them) and every alert (the table of its "Alerts" section).
    doc = OBS_DOC.read_text()
    metrics_doc = doc.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    alerts_doc = doc.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    row_names = re.compile(r"^\| `([a-zA-Z0-9_:]+)`", re.MULTILINE)
    assert set(row_names.findall(alerts_doc)) == {
        w.removeprefix("alert ") for w in alert_queries()}, "the alerts table is out of date"
    documented = set(row_names.findall(metrics_doc))
    sample_names = {n for n in exported.samples}
    missing = sorted(f for f, t in exported.families.items()
                     if not any(f == d or f + "_total" == d  # a counter with no samples yet
                                or (d in sample_names and exported.family_of[d] == f)
                                for d in documented)
                     and not f.endswith("_created"))
    assert not missing, f"docs/observability.md does not list {missing}"
    unknown = sorted(d for d in documented if d not in sample_names and d not in
                     exported.families and d.removesuffix("_total") not in exported.families)
    assert not unknown, f"docs/observability.md lists metrics the EPP does not export: {unknown}"


# ----------------------------------------------------------------------------- tools

def test_render_draws_every_panel(tmp_path: Path) -> None:
    """deploy/grafana/render.py's drawing half, from synthetic series (no stack)."""
    pytest.importorskip("matplotlib")
    import importlib.util

    spec = importlib.util.spec_from_file_location("epp_dash_render", DASHBOARD.parent / "render.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = render  # dataclasses look their module up there
    spec.loader.exec_module(render)
    dash = json.loads(DASHBOARD.read_text())
    data = {p["id"]: [(f"series {k}", [(1000.0 + 2 * i, float(i % 7)) for i in range(60)])
                      for k in range(len(p["targets"]))]
            for p in _panels(dash["panels"]) if p.get("targets")}
    out = tmp_path / "dash.png"
    render.draw(dash, data, 1000.0, 1120.0, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 50_000
    assert render.resolve('rate(x{m=~"$model",p=~"${pool}"}[$__rate_interval])', "10s") == \
        'rate(x{m=~".*",p=~".*"}[10s])'


def test_metrics_cost_bench_smoke(tmp_path: Path) -> None:
    """bench/metrics_cost.py runs and reports both cases."""
    from bench import metrics_cost

    out = tmp_path / "r.json"
    assert metrics_cost.main(["--blocks", "1", "--requests", "60", "--endpoints", "4",
                              "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["cpu_us_per_request_with_metrics"] > 0
    assert r["cpu_us_per_request_without_metrics"] > 0
    assert r["exposition_bytes"] > 1000
