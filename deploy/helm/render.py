"""`helm template` for deploy/helm/epp without the helm binary.

Renders the chart with Helm's own engine (the Go SDK, through the `helm-python-sdk`
package from PyPI) and prints the manifests as one multi-document YAML stream, like
`helm template`. Usage (from the repository root, in the project's venv):

    python deploy/helm/render.py [--name RELEASE] [--namespace NS]
                                 [-f values.yaml …] [--set key=value …]

With the helm CLI the equivalent is
`helm template RELEASE deploy/helm/epp -n NS -f values.yaml --set key=value`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent / "epp"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render(values: dict[str, Any], name: str = "epp", namespace: str = "default") -> str:
    """The rendered chart as multi-document YAML (templates in path order)."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name=name, namespace=namespace, is_install=True)
    docs = []
    for path in sorted(rendered):
        text = rendered[path].strip()
        if path.endswith(".yaml") and text:
            docs.append(f"# Source: {path}\n{text}")
    return "\n---\n".join(docs) + "\n"


def main(argv: list[str] | None = None) -> int:
    import helm_python as helm

    p = argparse.ArgumentParser(description="Render deploy/helm/epp (helm template).")
    p.add_argument("--name", default="epp")
    p.add_argument("--namespace", "-n", default="default")
    p.add_argument("-f", "--values", action="append", default=[])
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--lint", action="store_true",
                   help="run `helm lint --strict` instead; print its findings as JSON")
    args = p.parse_args(argv)
    if args.lint:
        report = helm.lint(str(CHART), strict=True, namespace=args.namespace)
        print(json.dumps(report, indent=2))
        return 1 if report.get("errors") else 0
    values: dict[str, Any] = {}
    for f in args.values:
        values = _merge(values, yaml.safe_load(Path(f).read_text()) or {})
    for s in args.set:
        values = _merge(values, helm.parse_set_string(s))
    sys.stdout.write(render(values, args.name, args.namespace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
