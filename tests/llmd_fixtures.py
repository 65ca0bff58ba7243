"""Reading the EndpointPickerConfig documents that llm-d ships, from the unchanged copies
under tests/fixtures/llm-d-router-v0.10.0/ and tests/fixtures/llm-d-inference-scheduler-
v0.8.0/ (their READMEs list the files and how each kind is read):

- YAML files: every document of ``kind: EndpointPickerConfig``; in Helm values files
  (test/perf/config/router-configs), each entry of ``router.epp.pluginsCustomConfig``
  that is one (:func:`yaml_configs`);
- Go test sources: the backquoted literals holding one (:func:`go_literals`; named by
  the constant, variable, map key or field they are assigned to), with their ``fmt``
  verbs filled as the Go test fills them (:data:`GO_FORMAT_ARGS`);
- Markdown: fenced code blocks holding one (:func:`markdown_configs`);
- the routerlib Helm chart's ConfigMap template: rendered for each configuration of its
  values that changes the documents (:func:`render_chart_configs`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

FIXTURES = Path(__file__).parent / "fixtures"
ROUTER = FIXTURES / "llm-d-router-v0.10.0"
SCHEDULER = FIXTURES / "llm-d-inference-scheduler-v0.8.0"

KIND = "kind: EndpointPickerConfig"


@dataclass(frozen=True)
class ShippedConfig:
    """One EndpointPickerConfig document: ``id`` (``<release>:<path>[#<name>]``), the
    fixture it comes from, its ``source`` kind (yaml, helm-values, go, markdown, chart)
    and its text."""

    id: str
    path: Path
    source: str
    text: str


def go_configs(path: Path) -> dict[str, str]:
    """The EndpointPickerConfig YAML literals of a Go test file (``const x = `…```` and
    ``"x": `…```` map entries), by name (tests/unit/scheduling/test_llmd_epd.py's
    helper)."""
    out = {}
    for m in re.finditer(r'(?:const (\w+) = |"(\w+)": )`([^`]*)`', path.read_text()):
        if "EndpointPickerConfig" in m.group(3):
            out[m.group(1) or m.group(2)] = m.group(3)
    return out


_GO_NAME = re.compile(r'(?:(\w+)\s*(?::=|=)|"([^"]+)"\s*:|(\w+)\s*:|return fmt\.Sprintf\(|'
                      r'(\w+)\()\s*$')

#: Files the Go tests write to a temporary directory and name in a literal (``%q``): a
#: token here, replaced by :func:`materialize` with such a file.
ENDPOINTS_FILE = "@ENDPOINTS_FILE@"
CLUSTERS_FILE = "@CLUSTERS_FILE@"
_FILES: Mapping[str, tuple[str, str]] = {
    # cmd/epp/runner/run_with_file_discovery_test.go (TestRunWithFileDiscovery_Smoke)
    ENDPOINTS_FILE: ("endpoints.yaml", ('endpoints:\n  - name: stub\n    address: 127.0.0.1\n'
                                       '    port: "19999"\n')),
    # cmd/epp/runner/multicluster_config_test.go
    CLUSTERS_FILE: ("clusters.yaml", ('endpoints:\n  - name: a\n    address: '
                                     'gw.cluster-a.example.com\n    port: "443"\n')),
}

_MC_EXTRACTOR = ("  - type: multicluster-metrics-extractor\n    name: metrics-extractor\n",
                 "      extractors:\n        - pluginRef: metrics-extractor\n")

#: ``fmt`` verbs in a Go literal, filled with the arguments the Go test passes (one
#: entry per call site or table case: each is its own document), by the name the literal
#: gets (:func:`go_literals`).
GO_FORMAT_ARGS: Mapping[str, tuple[tuple[str, ...], ...]] = {
    # test/integration/epp/session_affinity_test.go: fmt.Sprintf(pdConfigBase, …)
    "pdConfigBase": (("      deciders:\n        prefill: always-disagg-pd-decider",),
                     ("      {}",)),
    # test/e2e/configs_test.go kvConfig(): the vLLM render port (VLLM_RENDER_PORT).
    "kvConfig": (("8000",),),
    # cmd/epp/runner/multicluster_config_test.go: withExtractor true, then false.
    "multiClusterConfig": ((CLUSTERS_FILE, *_MC_EXTRACTOR), (CLUSTERS_FILE, "", "")),
    # cmd/epp/runner/run_with_file_discovery_test.go
    "TestRunWithFileDiscovery_Smoke": ((ENDPOINTS_FILE,),),
    "TestRunWithFileDiscovery_AlphaPluginBlockedByDefault": (
        (ENDPOINTS_FILE, "alpha-test-plugin"),),
    "TestRunWithFileDiscovery_AlphaPluginAllowedWithFlag": (
        (ENDPOINTS_FILE, "alpha-test-plugin-allowed"),),
}


def materialize(text: str, directory: Path) -> str:
    """``text`` with the file tokens of :data:`GO_FORMAT_ARGS` replaced by files written
    to ``directory`` with the content the Go test writes."""
    for token, (name, content) in _FILES.items():
        if token in text:
            path = directory / name
            path.write_text(content)
            text = text.replace(token, str(path))
    return text


def _go_name(text: str, start: int) -> str:
    """The identifier a literal starting at ``start`` is assigned to (or the function
    that returns it), else ''."""
    line_start = text.rfind("\n", 0, start) + 1
    before = text[line_start:start]
    m = _GO_NAME.search(before)
    if m is None:
        # e.g. `return fmt.Sprintf(` inside func kvConfig() on an earlier line
        func = list(re.finditer(r"^func (\w+)\(", text[:start], re.MULTILINE))
        return func[-1].group(1) if func else ""
    name = next((g for g in m.groups() if g), "")
    if not name or before.rstrip().endswith("Sprintf("):
        func = list(re.finditer(r"^func (\w+)\(", text[:start], re.MULTILINE))
        return func[-1].group(1) if func else name
    return name


def _fill_go_verbs(literal: str, args: tuple[str, ...]) -> str:
    it = iter(args)

    def repl(m: re.Match[str]) -> str:
        verb = m.group(1)
        value = next(it)
        return '"' + value + '"' if verb == "q" else value

    return re.sub(r"%([sdvq])", repl, literal)


def go_literals(path: Path) -> list[tuple[str, str]]:
    """(name, text) of every backquoted EndpointPickerConfig literal of a Go file, in
    order; a name that repeats gets ``#2``, ``#3``…; literals with ``fmt`` verbs are
    expanded with :data:`GO_FORMAT_ARGS` (a literal whose verbs have no entry there keeps
    them, and fails to load, naming the verb)."""
    text = path.read_text()
    out: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for m in re.finditer(r"`([^`]*)`", text):
        body = m.group(1)
        if KIND not in body:
            continue
        name = _go_name(text, m.start()) or "literal"
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name}#{seen[name]}"
        variants = GO_FORMAT_ARGS.get(name) if re.search(r"%[sdvq]", body) else None
        if variants:
            for i, args in enumerate(variants):
                out.append((label if len(variants) == 1 else f"{label}[{i}]",
                            _fill_go_verbs(body, args)))
        else:
            out.append((label, body))
    return out


def markdown_configs(path: Path) -> list[str]:
    """The EndpointPickerConfigs in the fenced code blocks of a Markdown file
    (indentation of an indented fence removed); a block of Helm values gives its
    ``router.epp.pluginsCustomConfig`` entries."""
    out = []
    for m in re.finditer(r"^([ \t]*)```[^\n]*\n(.*?)^[ \t]*```", path.read_text(),
                         re.MULTILINE | re.DOTALL):
        indent, body = m.group(1), m.group(2)
        if KIND not in body:
            continue
        text = "\n".join(line.removeprefix(indent)
                         for line in body.split("\n"))
        custom = _helm_custom_configs(text)
        out += custom if custom else [text]
    return out


def _helm_custom_configs(text: str) -> list[str]:
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return []
    out = []
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        custom = ((doc.get("router") or {}).get("epp") or {}).get("pluginsCustomConfig")
        if isinstance(custom, dict):
            out += [b for b in custom.values() if isinstance(b, str) and KIND in b]
    return out


def _epc_documents(text: str) -> list[str]:
    """The EndpointPickerConfig documents of a (possibly multi-document) YAML text, each
    as its own text."""
    parts = re.split(r"^---[ \t]*$", text, flags=re.MULTILINE)
    return [p for p in parts if KIND in p]


def yaml_configs(path: Path) -> list[tuple[str, str, str]]:
    """(name, source kind, text) of the EndpointPickerConfig documents of a YAML file:
    its own documents, or, for Helm values, each ``router.epp.pluginsCustomConfig``
    entry that is one (named by its file name there)."""
    text = path.read_text()
    out: list[tuple[str, str, str]] = []
    for doc in yaml.safe_load_all(text):
        if not isinstance(doc, dict):
            continue
        custom = ((doc.get("router") or {}).get("epp") or {}).get("pluginsCustomConfig")
        if isinstance(custom, dict):
            for fname, body in custom.items():
                if isinstance(body, str) and KIND in body:
                    out.append((str(fname), "helm-values", body))
    if out:
        return out
    docs = _epc_documents(text)
    return [(f"doc{i}" if len(docs) > 1 else "", "yaml", d) for i, d in enumerate(docs)]


# ---------------------------------------------------------------------- the chart

#: Values of the routerlib chart that change the EndpointPickerConfig it renders
#: (templates/_config.yaml): the model server type and protocol, an explicit parser
#: list, the latency predictor. The chart's defaults (values.yaml) first.
CHART_VARIANTS: Mapping[str, Mapping[str, Any]] = {
    "defaults": {},
    "vllm-grpc": {"modelServers.protocol": "grpc"},
    "triton": {"modelServers.type": "triton"},
    "sglang": {"modelServers.type": "sglang"},
    "parsers": {"epp.parsers": ["openai-parser", "anthropic-parser"]},
    "latency-predictor": {"latencyPredictor.enabled": True},
}

_CHART_DEFAULTS: Mapping[str, Any] = {
    # values.yaml (routerlib): router.epp.parsers [], metricsDataSource http /metrics true,
    # modelServers vllm / http, latencyPredictor.enabled false.
    "modelServers.type": "vllm",
    "modelServers.protocol": "http",
    "epp.parsers": [],
    "epp.metricsDataSource.scheme": "http",
    "epp.metricsDataSource.path": "/metrics",
    "epp.metricsDataSource.insecureSkipVerify": True,
    "latencyPredictor.enabled": False,
}


def _chart_env(values: Mapping[str, Any]) -> dict[str, Any]:
    v = {**_CHART_DEFAULTS, **values}
    server_type = v["modelServers.type"] or "vllm"
    protocol = v["modelServers.protocol"] or "http"
    parsers: list[str] = []
    if server_type.lower() == "vllm" and protocol.lower() == "grpc":
        parsers = ["vllmgrpc-parser"]
    elif v["epp.parsers"]:
        parsers = list(v["epp.parsers"])
    elif server_type.lower() == "triton":
        parsers = ["passthrough-parser"]
    return {"v": v, "type": server_type, "parsers": parsers}


# Each condition and expression of the template, by its exact text: a template change
# that adds another fails loudly (KeyError) instead of rendering wrongly.
_CONDITIONS: Mapping[str, Callable[[dict[str, Any]], bool]] = {
    'and (eq (lower $modelServerType) "vllm") (eq (lower $modelServerProtocol) "grpc")':
        lambda e: e["type"].lower() == "vllm"
        and (e["v"]["modelServers.protocol"] or "http").lower() == "grpc",
    ".Values.router.epp.parsers": lambda e: bool(e["v"]["epp.parsers"]),
    'eq (lower $modelServerType) "triton"': lambda e: e["type"].lower() == "triton",
    'ne $modelServerType "vllm"': lambda e: e["type"] != "vllm",
    ".Values.router.latencyPredictor.enabled": lambda e: bool(e["v"]["latencyPredictor.enabled"]),
    "$parsers": lambda e: bool(e["parsers"]),
}
_EXPRESSIONS: Mapping[str, Callable[[dict[str, Any]], str]] = {
    '.Values.router.epp.metricsDataSource.scheme | default "http" | quote':
        lambda e: '"' + (e["v"]["epp.metricsDataSource.scheme"] or "http") + '"',
    '.Values.router.epp.metricsDataSource.path | default "/metrics" | quote':
        lambda e: '"' + (e["v"]["epp.metricsDataSource.path"] or "/metrics") + '"',
    ".Values.router.epp.metricsDataSource.insecureSkipVerify | default true":
        lambda e: "true" if e["v"]["epp.metricsDataSource.insecureSkipVerify"] in (None, True)
        else "false",
    "$modelServerType | quote": lambda e: '"' + e["type"] + '"',
}


def _render_block(lines: list[str], env: dict[str, Any]) -> str:
    """Render a ConfigMap data block of the template (its control lines are whole
    ``{{- … }}`` lines; ``range $p := $parsers`` is the only loop)."""
    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (this branch active, some branch taken)
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.fullmatch(r"\s*\{\{-?\s*(.*?)\s*-?\}\}\s*", line)
        active = all(a for a, _ in stack)
        if m is not None:
            d = m.group(1)
            if d.startswith("if "):
                cond = _CONDITIONS[d[3:]](env) if active else False
                stack.append((cond, cond))
            elif d.startswith("else if "):
                _, taken = stack.pop()
                cond = not taken and _CONDITIONS[d[8:]](env)
                stack.append((cond, taken or cond))
            elif d == "else":
                _, taken = stack.pop()
                stack.append((not taken, True))
            elif d == "end":
                stack.pop()
            elif d.startswith("range $p := $parsers"):
                depth, j = 1, i + 1
                body: list[str] = []
                while True:
                    inner = re.fullmatch(r"\s*\{\{-?\s*(.*?)\s*-?\}\}\s*", lines[j])
                    if inner is not None and inner.group(1) == "end":
                        depth -= 1
                        if depth == 0:
                            break
                    body.append(lines[j])
                    j += 1
                if active:
                    for p in env["parsers"]:
                        out += [b.replace("{{ $p }}", p) for b in body]
                i = j
            elif re.fullmatch(r"\$\w+ :?= .*", d):
                pass  # the variables: computed by _chart_env
            else:
                raise KeyError(f"unknown template directive {d!r}")
            i += 1
            continue
        if active:
            out.append(re.sub(r"\{\{\s*(.*?)\s*\}\}", lambda x: _EXPRESSIONS[x.group(1)](env),
                              line))
        i += 1
    return "\n".join(out) + "\n"


def _chart_blocks(template: str) -> dict[str, list[str]]:
    """The ``data:`` entries of the template's EPP ConfigMap (``name: |`` blocks), their
    lines de-indented."""
    blocks: dict[str, list[str]] = {}
    current: str | None = None
    for line in template.split("\n"):
        m = re.fullmatch(r"  ([\w.-]+\.yaml): \|", line)
        if m is not None:
            current = m.group(1)
            blocks[current] = []
            continue
        if current is not None:
            if line.startswith("    ") or not line.strip():
                blocks[current].append(line[4:])
            else:
                current = None
    return blocks


def render_chart_configs(template_path: Path) -> list[tuple[str, str]]:
    """(name, text) of every EndpointPickerConfig the routerlib chart renders: its
    ``default-plugins.yaml`` for each of :data:`CHART_VARIANTS` and the static
    ``payload-agnostic.yaml`` (``pluginsCustomConfig`` entries come from values files:
    :func:`yaml_configs`)."""
    blocks = _chart_blocks(template_path.read_text())
    out: list[tuple[str, str]] = []
    for variant, values in CHART_VARIANTS.items():
        out.append((f"default-plugins.yaml[{variant}]",
                    _render_block(blocks["default-plugins.yaml"], _chart_env(values))))
    for name, lines in blocks.items():
        if name != "default-plugins.yaml":
            text = _render_block(lines, _chart_env({}))
            if KIND in text:
                out.append((name, text))
    return out


# ---------------------------------------------------------------------- everything


def shipped_configs(root: Path, release: str) -> list[ShippedConfig]:
    """Every EndpointPickerConfig document under a release's fixture directory."""
    out: list[ShippedConfig] = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.name == "README.md" and path.parent == root:
            continue
        rel = path.relative_to(root).as_posix()
        if path.suffix == ".go":
            for name, text in go_literals(path):
                out.append(ShippedConfig(f"{release}:{rel}#{name}", path, "go", text))
        elif path.suffix == ".md":
            blocks = markdown_configs(path)
            for i, text in enumerate(blocks):
                suffix = f"#{i + 1}" if len(blocks) > 1 else ""
                out.append(ShippedConfig(f"{release}:{rel}{suffix}", path, "markdown", text))
        elif rel.endswith("templates/_config.yaml"):
            for name, text in render_chart_configs(path):
                out.append(ShippedConfig(f"{release}:{rel}#{name}", path, "chart", text))
        elif path.suffix in (".yaml", ".yml"):
            if rel.endswith("routerlib/values.yaml"):
                continue  # its pluginsCustomConfig is {} (the example is a comment)
            for name, kind, text in yaml_configs(path):
                suffix = f"#{name}" if name else ""
                out.append(ShippedConfig(f"{release}:{rel}{suffix}", path, kind, text))
    return out
